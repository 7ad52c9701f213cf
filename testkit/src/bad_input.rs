//! The catalogue of bad inputs every server must survive (bad magic, bad version, CRC
//! mismatch, an oversized body, a frame cut off by close, random garbage), each with what
//! the server must do with it, and [`probe`], which sends one on a fresh connection and
//! reports what came back.

use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use rpcmesh_common::metrics::ErrorKind;
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::frame::Frame;

use crate::frames::echo_request;

/// How long a probe (and each read of [`crate::read_frames`]) waits for the server to
/// answer or close: a hang detector, as a server answers bad input within milliseconds.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// One kind of bad input and what a server must do with it.
#[derive(Debug, Clone)]
pub struct BadInput {
    /// Name for assertion messages.
    pub name: &'static str,
    /// Bytes to send.
    pub bytes: Vec<u8>,
    /// Close our write side after sending (a frame cut off by close).
    pub close_after: bool,
    /// The error kind the server must count.
    pub kind: ErrorKind,
    /// Request id of an error reply the server must send, if one is possible.
    pub reply_to: Option<u64>,
    /// True when the server must close the connection.
    pub closes: bool,
    /// A request id that must still be answered normally after the bad frame.
    pub then_answered: Option<u64>,
}

fn fix_crc(b: &mut BytesMut) {
    let n = b.len();
    let crc = crc32fast::hash(&b[..n - 4]);
    b[n - 4..].copy_from_slice(&crc.to_be_bytes());
}

/// Deterministic pseudo-random bytes with no `"RPCF"` in them.
pub fn garbage(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    for b in &mut v {
        if *b == b'R' {
            *b = b'r';
        }
    }
    v
}

/// The catalogue: bad magic, bad version, CRC mismatch, `body_len` over `max_body_len`, a
/// frame cut off by close, and random garbage.
pub fn bad_inputs(max_body_len: u32) -> Vec<BadInput> {
    let mut version = echo_request(11, "v");
    version[4] = 2;
    fix_crc(&mut version);

    let mut crc = echo_request(12, "crc");
    let n = crc.len();
    crc[n - 1] ^= 0x5a;
    crc.extend_from_slice(&echo_request(13, "after"));

    let mut too_large = echo_request(14, "big");
    too_large[6..10].copy_from_slice(&(max_body_len + 1).to_be_bytes());
    too_large.truncate(18);

    let whole = echo_request(15, "cut off by close");
    let cut = whole[..whole.len() - 7].to_vec();

    vec![
        BadInput {
            name: "bad magic",
            bytes: b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
            close_after: false,
            kind: ErrorKind::BadMagic,
            reply_to: None,
            closes: true,
            then_answered: None,
        },
        BadInput {
            name: "bad version",
            bytes: version.to_vec(),
            close_after: false,
            kind: ErrorKind::BadVersion,
            reply_to: None,
            closes: true,
            then_answered: None,
        },
        BadInput {
            name: "crc mismatch",
            bytes: crc.to_vec(),
            close_after: false,
            kind: ErrorKind::Crc,
            reply_to: Some(12),
            closes: false,
            then_answered: Some(13),
        },
        BadInput {
            name: "body_len over the limit",
            bytes: too_large.to_vec(),
            close_after: false,
            kind: ErrorKind::TooLarge,
            reply_to: Some(14),
            closes: true,
            then_answered: None,
        },
        BadInput {
            name: "frame cut off by close",
            bytes: cut,
            close_after: true,
            kind: ErrorKind::Truncated,
            reply_to: None,
            closes: true,
            then_answered: None,
        },
        BadInput {
            name: "random garbage",
            bytes: garbage(4096, 0x5eed),
            close_after: false,
            kind: ErrorKind::BadMagic,
            reply_to: None,
            closes: true,
            then_answered: None,
        },
    ]
}

/// What a probe saw.
#[derive(Debug, Default)]
pub struct Observed {
    /// Frames the server sent back.
    pub frames: Vec<Frame>,
    /// True when the server closed the connection.
    pub closed: bool,
}

/// Sends `input` on a fresh connection to `addr` and collects the server's frames until it
/// closes the connection, or until it has answered everything expected and stayed open.
pub async fn probe(addr: std::net::SocketAddr, input: &BadInput) -> std::io::Result<Observed> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(&input.bytes).await?;
    if input.close_after {
        s.shutdown().await?;
    }
    let expected =
        usize::from(input.reply_to.is_some()) + usize::from(input.then_answered.is_some());
    let codec = FrameCodec::default();
    let mut buf = BytesMut::new();
    let mut seen = Observed::default();
    let deadline = tokio::time::Instant::now() + PROBE_TIMEOUT;
    loop {
        if !input.closes && seen.frames.len() >= expected {
            return Ok(seen);
        }
        let n = match tokio::time::timeout_at(deadline, s.read_buf(&mut buf)).await {
            Err(_) => return Ok(seen),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => 0,
            Ok(r) => r?,
        };
        while let Ok(Some(f)) = codec.decode_frame(&mut buf) {
            seen.frames.push(f);
        }
        if n == 0 {
            seen.closed = true;
            return Ok(seen);
        }
    }
}
