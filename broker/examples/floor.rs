//! The floor of the broker's design: a forwarder with the broker's architecture and none of
//! its features, to measure what the design itself costs per call.
//!
//! Like the broker it runs one current-thread Tokio runtime, a task per client connection
//! and a task per provider connection, hands calls between them through buffers and a
//! wake-up, checks every frame where it lies with the broker's codec (magic, version,
//! length, CRC) and gives each call an id neutral to its CRC (`rpcmesh_wire::neutral`),
//! so a frame is copied with 8 bytes changed and its trailer kept, both ways. A provider
//! connection and a session let the runtime turn while more calls or replies come before
//! they write, as the broker's do, so that one `write` carries them. Nothing else: no names
//! read, no routing (every call goes to one provider connection), no caps, deadlines,
//! metrics, timeouts, retries, TLS or budget; bad frames are dropped; a provider connection
//! that fails ends the program. Not a product: a yardstick for `scripts/profile`, which runs it
//! as it runs the broker (it takes the broker's flags and ignores all but `--listen` and
//! `--upstream`):
//!
//! ```text
//! cargo build --release -p rpcmesh-broker --example floor
//! scripts/profile --no-build --broker target/release/broker --broker target/release/examples/floor
//! ```
//!
//! docs/performance.md ("What limits them") gives its figures beside the broker's.

use std::cell::RefCell;
use std::io;
use std::rc::Rc;

use bytes::{Buf, BytesMut};
use rpcmesh_wire::codec::{FrameCodec, skip_frame};
use rpcmesh_wire::frame::{DEFAULT_MAX_BODY_LEN, Header};
use tokio::io::AsyncReadExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

mod floor_shared;
use floor_shared::{READ_CHUNK, Slots, addresses, say_listening};

/// The room under which a read buffer grows (by [`READ_CHUNK`]), as the broker's.
const READ_ROOM: usize = 4 << 10;
/// Turns a session waits for more replies before it writes, at most, as the broker's.
const SESSION_GATHER_YIELDS: usize = 1;
/// Turns the provider connection waits for more calls before it writes, at most, as the
/// broker's.
const UPSTREAM_GATHER_YIELDS: usize = 4;

/// The provider connection's side of the hub: what to write, and the calls on it. One
/// connection, as the broker packs this load on one connection of its pool
/// (`--pack-in-flight`: 64 calls over 8 client connections ride its oldest connection; a
/// floor that spread them over four made four times the provider-side system calls).
#[derive(Default)]
struct Upstream {
    wbuf: BytesMut,
    wake: Rc<Notify>,
    slots: Slots,
}

/// A client connection's side of the hub: its replies to write.
struct Session {
    wbuf: BytesMut,
    wake: Rc<Notify>,
}

/// What the tasks share (one thread: a `RefCell`, never held across an await).
#[derive(Default)]
struct Hub {
    upstream: Upstream,
    sessions: Vec<Option<Session>>,
}

/// One socket's two halves, its read buffer checked with the broker's codec, and what it
/// has to write: what the session and the provider connection both are.
struct Link {
    rd: OwnedReadHalf,
    wr: OwnedWriteHalf,
    codec: FrameCodec,
    rbuf: BytesMut,
    out: BytesMut,
}

impl Link {
    fn new(s: TcpStream) -> io::Result<Link> {
        s.set_nodelay(true)?;
        let (rd, wr) = s.into_split();
        Ok(Link {
            rd,
            wr,
            codec: FrameCodec::new(DEFAULT_MAX_BODY_LEN),
            rbuf: BytesMut::new(),
            out: BytesMut::new(),
        })
    }

    /// Reads what the socket has; `Ok(0)` when the peer closed.
    async fn read(&mut self) -> io::Result<usize> {
        if self.rbuf.capacity() - self.rbuf.len() < READ_ROOM {
            self.rbuf.reserve(READ_CHUNK);
        }
        self.rd.read_buf(&mut self.rbuf).await
    }

    /// The whole frame at the front of the read buffer, checked where it lies
    /// ([`floor_shared::next_frame`]).
    fn next_frame(&mut self) -> Option<(Header, u32)> {
        floor_shared::next_frame(&self.codec, &mut self.rbuf)
    }

    /// Copies the frame `next_frame` found to `dst` under `header`, and drops it from the
    /// read buffer ([`floor_shared::forward`]).
    fn forward(&mut self, header: &Header, trailer: u32, dst: &mut BytesMut) {
        floor_shared::forward(&mut self.rbuf, header, trailer, dst);
    }

    /// Writes all of `out`, waiting while the socket takes nothing.
    async fn flush(&mut self) -> io::Result<()> {
        while !self.out.is_empty() {
            match self.wr.try_write(&self.out) {
                Ok(n) => self.out.advance(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wr.writable().await?,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Moves session `me`'s replies to `out`; how many bytes.
fn take_replies(hub: &RefCell<Hub>, me: usize, out: &mut BytesMut) -> usize {
    let mut h = hub.borrow_mut();
    let Some(Some(mine)) = h.sessions.get_mut(me) else {
        return 0;
    };
    let n = mine.wbuf.len();
    if out.is_empty() {
        std::mem::swap(out, &mut mine.wbuf);
    } else {
        out.extend_from_slice(&mine.wbuf);
        mine.wbuf.clear();
    }
    n
}

async fn session(s: TcpStream, me: usize, hub: Rc<RefCell<Hub>>, wake: Rc<Notify>) {
    if let Ok(mut link) = Link::new(s) {
        let _ = serve(&mut link, me, &hub, &wake).await;
    }
    hub.borrow_mut().sessions[me] = None;
}

async fn serve(link: &mut Link, me: usize, hub: &RefCell<Hub>, wake: &Notify) -> io::Result<()> {
    loop {
        tokio::select! {
            r = link.read() => {
                if r? == 0 {
                    return Ok(());
                }
                let mut h = hub.borrow_mut();
                let up = &mut h.upstream;
                while let Some((mut header, trailer)) = link.next_frame() {
                    header.req_id = up.slots.give(me, header.req_id);
                    link.forward(&header, trailer, &mut up.wbuf);
                    up.wake.notify_one();
                }
            }
            () = wake.notified() => {}
        }
        // As the broker's sessions do: while replies keep coming, a turn more before the
        // write, so that one write carries them.
        if take_replies(hub, me, &mut link.out) > 0 {
            for _ in 0..SESSION_GATHER_YIELDS {
                tokio::task::yield_now().await;
                if take_replies(hub, me, &mut link.out) == 0 {
                    break;
                }
            }
        }
        link.flush().await?;
    }
}

async fn upstream(s: TcpStream, hub: Rc<RefCell<Hub>>, wake: Rc<Notify>) -> io::Result<()> {
    let mut link = Link::new(s)?;
    loop {
        tokio::select! {
            r = link.read() => {
                if r? == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                let mut h = hub.borrow_mut();
                let h = &mut *h;
                while let Some((mut header, trailer)) = link.next_frame() {
                    match h.upstream.slots.take(header.req_id) {
                        Some((session, caller_id)) => {
                            match h.sessions.get_mut(session) {
                                Some(Some(to)) => {
                                    header.req_id = caller_id;
                                    link.forward(&header, trailer, &mut to.wbuf);
                                    to.wake.notify_one();
                                }
                                _ => skip_frame(&mut link.rbuf, &header),
                            }
                        }
                        None => skip_frame(&mut link.rbuf, &header),
                    }
                }
            }
            () = wake.notified() => {
                // The sessions read in this turn add their calls first: one write.
                for _ in 0..UPSTREAM_GATHER_YIELDS {
                    let before = hub.borrow().upstream.wbuf.len();
                    tokio::task::yield_now().await;
                    if hub.borrow().upstream.wbuf.len() == before {
                        break;
                    }
                }
            }
        }
        std::mem::swap(&mut link.out, &mut hub.borrow_mut().upstream.wbuf);
        link.flush().await?;
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (listen, to) = addresses("floor")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let hub = Rc::new(RefCell::new(Hub::default()));
        let s = TcpStream::connect(to).await?;
        let wake = hub.borrow().upstream.wake.clone();
        let mut failed = tokio::task::spawn_local(upstream(s, hub.clone(), wake));
        let l = TcpListener::bind(listen).await?;
        say_listening("floor", l.local_addr()?);
        loop {
            tokio::select! {
                accepted = l.accept() => {
                    let (s, _) = accepted?;
                    let wake = Rc::new(Notify::new());
                    let me = {
                        let mut h = hub.borrow_mut();
                        let wbuf = BytesMut::new();
                        h.sessions.push(Some(Session { wbuf, wake: wake.clone() }));
                        h.sessions.len() - 1
                    };
                    tokio::task::spawn_local(session(s, me, hub.clone(), wake));
                }
                r = &mut failed => {
                    let e = r.map_err(io::Error::other).and_then(|r| r).err();
                    return Err(format!("a provider connection ended: {e:?}").into());
                }
            }
        }
    })
}
