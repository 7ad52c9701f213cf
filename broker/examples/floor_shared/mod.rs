//! What the two floors (`floor`, on the broker's Tokio runtime, and `floor_epoll`, on one
//! epoll loop of its own) do alike: every frame checked where it lies with the broker's
//! codec, copied under an id neutral to its CRC, matched back by its key, and the
//! broker's `--listen` and `--upstream` flags read. What differs between them is only how
//! the sockets are waited on and the work handed along, which is what they compare.

use std::net::SocketAddr;

use bytes::BytesMut;
use rpcmesh_wire::codec::{FrameCodec, body_in_place, skip_frame, trailer_in_place};
use rpcmesh_wire::frame::{Header, put_frame_with_trailer};
use rpcmesh_wire::neutral::neutral_id;

/// What a read takes at most, the broker's own: `floor` grows its read buffers by this
/// much, `floor_epoll` reads into a scratch buffer this large (a read that fills it may
/// have left more behind).
pub use rpcmesh_common::net::connection::READ_CHUNK;

/// The whole frame at the front of `src`, checked where it lies: its header and trailer,
/// `None` when it is not all there. A bad frame's bytes are dropped (the codec's doing).
pub fn next_frame(codec: &FrameCodec, src: &mut BytesMut) -> Option<(Header, u32)> {
    loop {
        match codec.peek_frame(src) {
            Ok(Some(h)) => return Some((h, trailer_in_place(src, &h))),
            Ok(None) => return None,
            Err(e) if e.is_fatal() => {
                src.clear();
                return None;
            }
            Err(_) => {}
        }
    }
}

/// Copies the frame [`next_frame`] found under `header` (its id changed, `trailer` kept)
/// to `dst`, and drops it from `src`.
pub fn forward(src: &mut BytesMut, header: &Header, trailer: u32, dst: &mut BytesMut) {
    put_frame_with_trailer(dst, header, body_in_place(src, header), trailer);
    skip_frame(src, header);
}

/// The calls on the provider connection, by key (the id's low 32 bits): the session, the
/// caller's id and the id given.
#[derive(Default)]
pub struct Slots {
    slots: Vec<Option<(usize, u64, u64)>>,
    free: Vec<u32>,
}

impl Slots {
    /// Gives session `session`'s call `caller_id` a slot; the id to send it under.
    pub fn give(&mut self, session: usize, caller_id: u64) -> u64 {
        let key = self.free.pop().unwrap_or_else(|| {
            self.slots.push(None);
            u32::try_from(self.slots.len() - 1).unwrap_or(u32::MAX)
        });
        let id = neutral_id(caller_id, key);
        self.slots[key as usize] = Some((session, caller_id, id));
        id
    }

    /// The session and caller's id of the call sent under `given`, its slot freed; `None`
    /// for an id no call has.
    pub fn take(&mut self, given: u64) -> Option<(usize, u64)> {
        let key = given as u32;
        let slot = self.slots.get_mut(key as usize)?;
        let (session, caller_id, _) = slot.take_if(|s| s.2 == given)?;
        self.free.push(key);
        Some((session, caller_id))
    }
}

/// Prints the line a server prints once it listens (with no metrics endpoint), so that
/// the scripts that start the broker (`scripts/bench --baseline-broker`) start a floor
/// alike.
pub fn say_listening(program: &str, rpc: SocketAddr) {
    println!(
        "{}",
        rpcmesh_common::cli::startup::listening_line(program, rpc, None)
    );
}

/// The value of the broker's flag `name` on the command line (`--name VALUE`), if given:
/// the word after its first occurrence, wherever it stands (the broker's flags without a
/// value, such as `--allow-empty-providers`, do not shift it).
pub fn flag(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1).cloned()
}

/// `--listen` and `--upstream` of the broker's flags.
pub fn addresses(program: &str) -> Result<(SocketAddr, SocketAddr), String> {
    let parse = |name| flag(name).and_then(|v| v.parse::<SocketAddr>().ok());
    match (parse("--listen"), parse("--upstream")) {
        (Some(l), Some(u)) => Ok((l, u)),
        _ => Err(format!(
            "usage: {program} --listen IP:PORT --upstream IP:PORT [broker flags, ignored]"
        )),
    }
}
