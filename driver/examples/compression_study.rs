//! Compression study: what zlib does to rpcmesh's payloads, byte by byte and nanosecond by
//! nanosecond, and why the reference workload saves so little.
//!
//! ```text
//! cargo run --release --example compression_study -p rpcmesh-driver            # 100k ops x 5 batches
//! cargo run --release --example compression_study -p rpcmesh-driver -- --quick # 10k ops x 3 batches
//! cargo run --release --example compression_study -p rpcmesh-driver -- --ops 50000 --batches 7
//! ```
//!
//! Needs `flate2` as a dev-dependency of the driver (`flate2.workspace = true` under
//! `[dev-dependencies]` in `driver/Cargo.toml`), for the window-bits and reset-vs-new
//! measurements that `rpcmesh_wire::compress` does not expose.
//!
//! The payloads are the real ones: requests are encoded by the driver's own
//! [`Workload::encode`] through [`CallCodec`], replies by the provider's built-in handlers
//! (looked up in [`Registry::builtin`]) and [`CallCodec::put_ok_response`], exactly as the
//! session does. What zlib sees is what `compress_into` sees: the protobuf envelope
//! (`rpc.RpcRequest` / `rpc.RpcResponse` around the application message), not the frame.
//!
//! Sizes and times at levels 1/2/6/9 use `rpcmesh_wire::compress::{Compressor, Inflater}`
//! themselves (reset per message, as a connection does). Window bits, `reset()` alone and
//! a fresh `Compress::new` per message use `flate2` directly, with the same settings (zlib
//! header on, level as given). Every zlib stream is also taken apart by a small deflate
//! parser below, to split its bytes into fixed overhead (2-byte header, block headers,
//! end-of-block codes, padding, 4-byte Adler-32) and coded payload (literals, matches).
//!
//! Output: Markdown tables on stdout.

use std::hint::black_box;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};
use prost::Message;
use rpcmesh_driver::WorkloadKind;
use rpcmesh_driver::workload::Workload;
use rpcmesh_provider::service::{Lookup, Outcome, Registry};
use rpcmesh_wire::body::{Request, Response};
use rpcmesh_wire::compress::{
    CompressionConfig, Compressor, DEFAULT_COMPRESS_LEVEL, DEFAULT_COMPRESS_THRESHOLD,
    DEFAULT_MAX_INFLATED_LEN, Inflater,
};
use rpcmesh_wire::envelope::CallCodec;
use rpcmesh_wire::frame::{Flags, Frame, HEADER_LEN, TRAILER_LEN};
use rpcmesh_wire::proto::rpc::RpcRequest;

// ---------------------------------------------------------------------------------------
// Payloads
// ---------------------------------------------------------------------------------------

/// One message as it travels.
struct Payload {
    name: &'static str,
    /// The application message (protobuf), as the handler or the workload encodes it.
    app: Bytes,
    /// The `rpc.RpcRequest` / `rpc.RpcResponse` envelope: what the compressor is given.
    envelope: Bytes,
    /// The whole plain frame.
    frame_plain: usize,
    /// The whole frame as `CallCodec` writes it with the default compression config.
    frame_default: usize,
    /// Whether it went out compressed with the default config.
    compressed_by_default: bool,
    /// Frame bytes by part: header, names/status, payload length field, CRC.
    parts: FrameParts,
}

#[derive(Clone, Copy)]
struct FrameParts {
    header: usize,
    prefix: usize,
    len_field: usize,
    crc: usize,
}

/// Flags the driver sets when compression is on (worker.rs): extended statuses and
/// compressed replies accepted.
fn call_flags() -> Flags {
    Flags::EXT_STATUS | Flags::ACCEPT_COMPRESSED
}

/// The request and the provider's reply of one workload, as the driver and the provider
/// encode them.
fn call_payloads(
    req_name: &'static str,
    reply_name: &'static str,
    kind: WorkloadKind,
    size: usize,
) -> [Payload; 2] {
    let workload = Workload::new(kind, size);
    let (service, method) = workload.target();

    // Request: the driver's encoder, plain and with the default compression.
    let mut plain = CallCodec::new(None, DEFAULT_MAX_INFLATED_LEN);
    let mut zdef = CallCodec::new(Some(CompressionConfig::default()), DEFAULT_MAX_INFLATED_LEN);
    let mut b = BytesMut::new();
    workload
        .encode(&mut plain, &mut b, 1, call_flags())
        .expect("request encodes");
    let req_frame = Frame::from_bytes(b.split().freeze()).expect("request frame parses");
    workload
        .encode(&mut zdef, &mut b, 1, call_flags())
        .expect("request encodes");
    let req_default = Frame::from_bytes(b.split().freeze()).expect("request frame parses");
    let req = Request::parse(&req_frame.body).expect("request body parses");
    let rpc = RpcRequest::decode(req.payload.clone()).expect("envelope decodes");
    let request = Payload {
        name: req_name,
        app: rpc.payload.clone(),
        envelope: req.payload.clone(),
        frame_plain: HEADER_LEN + req_frame.body.len() + TRAILER_LEN,
        frame_default: HEADER_LEN + req_default.body.len() + TRAILER_LEN,
        compressed_by_default: req_default.header.flags.contains(Flags::COMPRESSED),
        parts: FrameParts {
            header: HEADER_LEN,
            prefix: 2 + service.len() + 2 + method.len(),
            len_field: 4,
            crc: TRAILER_LEN,
        },
    };

    // Reply: the provider's own handler, then the session's response encoder.
    let registry = Registry::builtin();
    let Lookup::Found(handler, _) = registry.lookup(service.as_bytes(), method.as_bytes()) else {
        panic!("{service}.{method} is not a built-in method");
    };
    let mut answer = BytesMut::new();
    match handler.call(rpc, &mut answer) {
        Outcome::Ready(Ok(())) => {}
        other => panic!("the handler did not answer inline: {other:?}"),
    }
    assert!(
        workload.check(&answer).is_ok(),
        "the reply is the expected one"
    );
    let reply = reply_payload(reply_name, answer.freeze());
    [request, reply]
}

/// A successful reply carrying `answer`, as the provider's session writes it.
fn reply_payload(name: &'static str, answer: Bytes) -> Payload {
    let mut plain = CallCodec::new(None, DEFAULT_MAX_INFLATED_LEN);
    let mut zdef = CallCodec::new(Some(CompressionConfig::default()), DEFAULT_MAX_INFLATED_LEN);
    let mut b = BytesMut::new();
    plain
        .put_ok_response(&mut b, 1, call_flags(), &answer)
        .expect("reply encodes");
    let resp_frame = Frame::from_bytes(b.split().freeze()).expect("reply frame parses");
    zdef.put_ok_response(&mut b, 1, call_flags(), &answer)
        .expect("reply encodes");
    let resp_default = Frame::from_bytes(b.split().freeze()).expect("reply frame parses");
    let resp = Response::parse(&resp_frame.body).expect("reply body parses");
    Payload {
        name,
        app: answer,
        envelope: resp.payload.clone(),
        frame_plain: HEADER_LEN + resp_frame.body.len() + TRAILER_LEN,
        frame_default: HEADER_LEN + resp_default.body.len() + TRAILER_LEN,
        compressed_by_default: resp_default.header.flags.contains(Flags::COMPRESSED),
        parts: FrameParts {
            header: HEADER_LEN,
            prefix: 1,
            len_field: 4,
            crc: TRAILER_LEN,
        },
    }
}

/// Not a workload of the driver: a platform answer of 30 distinct entries (ids, names,
/// company ids and dates all differ), to see a bigger protobuf message with realistic
/// redundancy (field tags and common prefixes, no verbatim repeats).
fn synthetic_answer() -> Bytes {
    use rpcmesh_wire::proto::platform::{NodeInfo, QueryResponse};
    let nodes = (0..30u32)
        .map(|i| NodeInfo {
            node_id: 100_001 + i64::from(i) * 37,
            node_name: format!("機構{}", 100_001 + i * 37),
            company_id: format!("{}", 1200 + (i * 7919) % 1000),
            create_date: format!("2016{:02}{:02}", 1 + i % 12, 1 + (i * 11) % 28),
        })
        .collect();
    QueryResponse { nodes }.encode_to_vec().into()
}

// ---------------------------------------------------------------------------------------
// Timing
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy)]
struct Plan {
    ops: usize,
    batches: usize,
}

/// Median ns per op over `plan.batches` batches of `ops` calls (after a warm-up batch of
/// a tenth).
fn median_ns(plan: Plan, ops: usize, spread: &mut Spread, mut f: impl FnMut()) -> f64 {
    let ops = ops.max(1);
    for _ in 0..ops.div_ceil(10) {
        f();
    }
    let mut v: Vec<f64> = (0..plan.batches.max(1))
        .map(|_| {
            let t = Instant::now();
            for _ in 0..ops {
                f();
            }
            t.elapsed().as_nanos() as f64 / ops as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    let med = v[v.len() / 2];
    let s = (v[v.len() - 1] - v[0]) / med;
    spread.worst = spread.worst.max(s);
    med
}

/// Worst (max - min) / median over all measurements, to report the noise.
#[derive(Default)]
struct Spread {
    worst: f64,
}

// ---------------------------------------------------------------------------------------
// zlib through rpcmesh_wire::compress (the code's own pattern)
// ---------------------------------------------------------------------------------------

/// The zlib stream `Compressor::compress_into` makes of `input` (threshold forced to 1 so
/// that small payloads are tried too), or `None` when it would go plain (no gain).
fn wire_compress(input: &[u8], level: u32) -> Option<Vec<u8>> {
    let mut c = Compressor::new(CompressionConfig {
        threshold: 1,
        level,
    });
    let mut dst = BytesMut::new();
    c.compress_into(input, &mut dst).then(|| dst.to_vec())
}

/// Any zlib stream of `input` (even a longer one), via flate2 with the same settings.
fn zlib(input: &[u8], level: u32, window_bits: u8) -> Vec<u8> {
    let mut c = Compress::new_with_window_bits(Compression::new(level), true, window_bits);
    let mut out = vec![0u8; input.len() + 64];
    let st = c
        .compress(input, &mut out, FlushCompress::Finish)
        .expect("deflate works");
    assert_eq!(st, Status::StreamEnd);
    out.truncate(c.total_out() as usize);
    out
}

/// ns per `compress_into` (reset + deflate + buffer handling), and per `inflate_into`.
fn time_wire(plan: Plan, sp: &mut Spread, input: &[u8], level: u32) -> (f64, f64) {
    let mut c = Compressor::new(CompressionConfig {
        threshold: 1,
        level,
    });
    let mut dst = BytesMut::with_capacity(2 * input.len() + 256);
    let z = zlib(input, level, 15);
    let comp = median_ns(plan, plan.ops, sp, || {
        dst.clear();
        black_box(c.compress_into(black_box(input), &mut dst));
    });
    let mut i = Inflater::new(DEFAULT_MAX_INFLATED_LEN);
    let mut out = BytesMut::with_capacity(4 * input.len() + 256);
    let infl = median_ns(plan, plan.ops, sp, || {
        out.clear();
        i.inflate_into(black_box(&z), &mut out).expect("inflates");
        black_box(&out);
    });
    assert_eq!(&out[..], input);
    (comp, infl)
}

// ---------------------------------------------------------------------------------------
// A small deflate parser: where the bits of a zlib stream go
// ---------------------------------------------------------------------------------------

#[derive(Default, Clone)]
struct Anatomy {
    total: usize,
    /// Block types in order: S(tored), F(ixed Huffman), D(ynamic Huffman).
    blocks: String,
    header_bits: usize,
    eob_bits: usize,
    pad_bits: usize,
    literals: usize,
    literal_bits: usize,
    matches: Vec<(usize, usize)>,
    match_bits: usize,
}

impl Anatomy {
    /// Bytes that do not depend on the payload: zlib header + Adler-32 + deflate block
    /// headers + end-of-block codes + padding to a byte.
    fn fixed_bytes(&self) -> f64 {
        6.0 + (self.header_bits + self.eob_bits + self.pad_bits) as f64 / 8.0
    }
    fn matched_bytes(&self) -> usize {
        self.matches.iter().map(|m| m.0).sum()
    }
}

struct Bits<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Bits<'_> {
    fn bit(&mut self) -> u32 {
        let b = (self.data[self.pos / 8] >> (self.pos % 8)) & 1;
        self.pos += 1;
        u32::from(b)
    }
    fn bits(&mut self, n: u32) -> u32 {
        (0..n).fold(0, |v, i| v | (self.bit() << i))
    }
}

/// Canonical Huffman code, decoded as zlib's `puff` does.
struct Huff {
    count: [u16; 16],
    symbol: Vec<u16>,
}

impl Huff {
    fn new(lengths: &[u8]) -> Huff {
        let mut count = [0u16; 16];
        for &l in lengths {
            count[l as usize] += 1;
        }
        count[0] = 0;
        let mut offs = [0u16; 16];
        for len in 1..15 {
            offs[len + 1] = offs[len] + count[len];
        }
        let mut symbol = vec![0u16; lengths.len()];
        for (s, &l) in lengths.iter().enumerate() {
            if l != 0 {
                symbol[offs[l as usize] as usize] = s as u16;
                offs[l as usize] += 1;
            }
        }
        Huff { count, symbol }
    }

    /// (symbol, bits used)
    fn decode(&self, b: &mut Bits<'_>) -> (usize, usize) {
        let (mut code, mut first, mut index) = (0i32, 0i32, 0i32);
        for len in 1..16 {
            code |= b.bit() as i32;
            let count = i32::from(self.count[len]);
            if code - count < first {
                return (self.symbol[(index + code - first) as usize] as usize, len);
            }
            index += count;
            first += count;
            first <<= 1;
            code <<= 1;
        }
        panic!("bad Huffman code");
    }
}

const LBASE: [usize; 29] = [
    3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131,
    163, 195, 227, 258,
];
const LEXT: [u32; 29] = [
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0,
];
const DBASE: [usize; 30] = [
    1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537,
    2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577,
];
const DEXT: [u32; 30] = [
    0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13,
    13,
];

/// Takes a zlib stream apart and checks that it inflates to `expect`.
fn anatomy(z: &[u8], expect: &[u8]) -> Anatomy {
    let mut a = Anatomy {
        total: z.len(),
        ..Anatomy::default()
    };
    assert!(z.len() >= 6 && (u16::from(z[0]) << 8 | u16::from(z[1])) % 31 == 0);
    let mut b = Bits {
        data: &z[..z.len() - 4],
        pos: 16,
    };
    let mut out: Vec<u8> = Vec::new();
    loop {
        let start = b.pos;
        let last = b.bit() == 1;
        let btype = b.bits(2);
        match btype {
            0 => {
                a.blocks.push('S');
                b.pos = b.pos.div_ceil(8) * 8;
                let len = b.bits(16) as usize;
                let _nlen = b.bits(16);
                a.header_bits += b.pos - start;
                for _ in 0..len {
                    out.push(b.bits(8) as u8);
                }
                a.literals += len;
                a.literal_bits += 8 * len;
            }
            1 | 2 => {
                let (lit, dist) = if btype == 1 {
                    a.blocks.push('F');
                    let mut l = [8u8; 288];
                    l[144..256].fill(9);
                    l[256..280].fill(7);
                    (Huff::new(&l), Huff::new(&[5u8; 30]))
                } else {
                    a.blocks.push('D');
                    let hlit = b.bits(5) as usize + 257;
                    let hdist = b.bits(5) as usize + 1;
                    let hclen = b.bits(4) as usize + 4;
                    const ORDER: [usize; 19] = [
                        16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15,
                    ];
                    let mut cl = [0u8; 19];
                    for &o in &ORDER[..hclen] {
                        cl[o] = b.bits(3) as u8;
                    }
                    let clh = Huff::new(&cl);
                    let mut lens = Vec::with_capacity(hlit + hdist);
                    while lens.len() < hlit + hdist {
                        let (sym, _) = clh.decode(&mut b);
                        match sym {
                            0..=15 => lens.push(sym as u8),
                            16 => {
                                let prev = *lens.last().expect("repeat after a length");
                                let n = 3 + b.bits(2);
                                lens.extend(std::iter::repeat_n(prev, n as usize));
                            }
                            17 => {
                                let n = 3 + b.bits(3);
                                lens.extend(std::iter::repeat_n(0, n as usize));
                            }
                            _ => {
                                let n = 11 + b.bits(7);
                                lens.extend(std::iter::repeat_n(0, n as usize));
                            }
                        }
                    }
                    (Huff::new(&lens[..hlit]), Huff::new(&lens[hlit..]))
                };
                a.header_bits += b.pos - start;
                loop {
                    let (sym, n) = lit.decode(&mut b);
                    if sym < 256 {
                        out.push(sym as u8);
                        a.literals += 1;
                        a.literal_bits += n;
                    } else if sym == 256 {
                        a.eob_bits += n;
                        break;
                    } else {
                        let s = sym - 257;
                        let len = LBASE[s] + b.bits(LEXT[s]) as usize;
                        let (d, dn) = dist.decode(&mut b);
                        let distance = DBASE[d] + b.bits(DEXT[d]) as usize;
                        a.match_bits += n + LEXT[s] as usize + dn + DEXT[d] as usize;
                        a.matches.push((len, distance));
                        for _ in 0..len {
                            out.push(out[out.len() - distance]);
                        }
                    }
                }
            }
            _ => panic!("reserved block type"),
        }
        if last {
            break;
        }
    }
    a.pad_bits = (8 - b.pos % 8) % 8;
    let bits = 16 + a.header_bits + a.eob_bits + a.pad_bits + a.literal_bits + a.match_bits + 32;
    assert_eq!(
        bits,
        8 * z.len(),
        "every bit of the stream is accounted for"
    );
    assert_eq!(out, expect, "the parser inflates the stream to the payload");
    a
}

// ---------------------------------------------------------------------------------------
// Output helpers
// ---------------------------------------------------------------------------------------

fn pct(part: f64, whole: f64) -> String {
    format!("{:.0} %", 100.0 * part / whole)
}

fn saving(plain: usize, z: usize) -> String {
    format!("{:+.0} %", 100.0 * (z as f64 - plain as f64) / plain as f64)
}

fn size_cell(plain: usize, z: Option<&Vec<u8>>, raw: &[u8]) -> String {
    match z {
        Some(z) => format!("{} ({})", z.len(), saving(plain, z.len())),
        None => format!("plain (zlib: {})", raw.len()),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter()
        .map(|x| format!("{x:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn printable(b: &[u8]) -> String {
    String::from_utf8_lossy(b)
        .chars()
        .map(|c| if c.is_control() { '·' } else { c })
        .collect()
}

/// Approximate zlib-rs deflate state for a window (see `DeflateAllocOffsets` in zlib-rs:
/// window 2·2^w, prev 2·2^w, head 2·65536, pending 4·16384, symbols 3·16384), in KiB.
fn deflate_state_kib(window_bits: u8) -> usize {
    let w = 1usize << window_bits;
    (2 * w + 2 * w + 2 * 65536 + 4 * 16384 + 3 * 16384) / 1024
}

// ---------------------------------------------------------------------------------------

fn main() {
    let mut plan = Plan {
        ops: 100_000,
        batches: 5,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |what: &str| -> usize {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{what} needs a number"))
        };
        match a.as_str() {
            "--ops" => plan.ops = num("--ops"),
            "--batches" => plan.batches = num("--batches"),
            "--quick" => {
                plan.ops = 10_000;
                plan.batches = 3;
            }
            other => panic!("unknown argument {other} (--ops N, --batches N, --quick)"),
        }
    }
    let mut sp = Spread::default();

    let [preq, prep] = call_payloads(
        "platform request",
        "platform reply",
        WorkloadKind::Platform,
        0,
    );
    let [e32, e32r] = call_payloads(
        "echo 32 B request",
        "echo 32 B reply",
        WorkloadKind::Echo,
        32,
    );
    let [e1k, e1kr] = call_payloads(
        "echo 1 KiB request",
        "echo 1 KiB reply",
        WorkloadKind::Echo,
        1024,
    );
    let syn = reply_payload("synthetic reply, 30 distinct entries", synthetic_answer());
    let all = [&preq, &prep, &e32, &e32r, &e1k, &e1kr, &syn];
    let timed = [&preq, &prep, &e32, &e1k, &syn];
    let levels = [1u32, 2, 6, 9];
    let lv = |f: &dyn Fn(u32) -> String| levels.iter().map(|&l| f(l)).collect::<Vec<_>>();

    println!("# rpcmesh compression study\n");
    println!(
        "zlib via flate2 (zlib-rs backend). Defaults: level {DEFAULT_COMPRESS_LEVEL}, threshold \
         {DEFAULT_COMPRESS_THRESHOLD} B. Times: median of {} batches of {} ops (warm state, \
         one connection), ns per op.\n",
        plan.batches, plan.ops
    );

    // 1. Sizes -------------------------------------------------------------------------
    println!("## 1. Sizes: the envelope zlib is given, at levels 1 / 2 / 6 / 9\n");
    println!(
        "`compress_into` with the threshold forced to 1; \"plain\" = output not shorter, so \
         the code would send it plain. Blocks: F = fixed Huffman, D = dynamic, S = stored.\n"
    );
    println!(
        "| payload | app msg B | envelope B | {} | blocks {} | default config sends |",
        lv(&|l| format!("L{l}")).join(" | "),
        lv(&|l| format!("L{l}")).join("/")
    );
    println!("|---|---:|---:|{}---|---|", "---:|".repeat(levels.len()));
    for p in all {
        let env = &p.envelope[..];
        let mut cells = Vec::new();
        let mut blocks = Vec::new();
        for &l in &levels {
            let raw = zlib(env, l, 15);
            let z = wire_compress(env, l);
            if let Some(z) = &z {
                assert_eq!(z, &raw, "Compressor and flate2 agree");
            }
            blocks.push(anatomy(&raw, env).blocks);
            cells.push(size_cell(env.len(), z.as_ref(), &raw));
        }
        let default = if env.len() < DEFAULT_COMPRESS_THRESHOLD {
            "plain (below threshold)".to_string()
        } else if p.compressed_by_default {
            "compressed".to_string()
        } else {
            "plain (no gain)".to_string()
        };
        println!(
            "| {} | {} | {} | {} | {} | {} |",
            p.name,
            p.app.len(),
            env.len(),
            cells.join(" | "),
            blocks.join("/"),
            default
        );
    }

    // 2. Anatomy -----------------------------------------------------------------------
    println!("\n## 2. Where the zlib bytes go (level 6)\n");
    println!(
        "fixed = 2 B zlib header + 4 B Adler-32 + block header bits + end-of-block code + \
         padding: paid by every message whatever its content.\n"
    );
    println!(
        "| payload | plain B | zlib B | fixed B | literals (count → B) | matches (count, bytes covered → B) | fixed share of output |"
    );
    println!("|---|---:|---:|---:|---|---|---:|");
    for p in all {
        let env = &p.envelope[..];
        let z = zlib(env, 6, 15);
        let a = anatomy(&z, env);
        println!(
            "| {} | {} | {} | {:.1} | {} → {:.1} | {}, {} → {:.1} | {} |",
            p.name,
            env.len(),
            a.total,
            a.fixed_bytes(),
            a.literals,
            a.literal_bits as f64 / 8.0,
            a.matches.len(),
            a.matched_bytes(),
            a.match_bits as f64 / 8.0,
            pct(a.fixed_bytes(), a.total as f64),
        );
    }
    for p in [&preq, &prep] {
        let z = zlib(&p.envelope, 6, 15);
        let a = anatomy(&z, &p.envelope);
        println!("\n{} envelope ({} B):\n", p.name, p.envelope.len());
        println!(
            "```text\n{}\n{}\n```",
            hex(&p.envelope),
            printable(&p.envelope)
        );
        let ms: Vec<String> = a
            .matches
            .iter()
            .map(|&(len, dist)| format!("{len} B from {dist} back"))
            .collect();
        println!(
            "deflate matches at level 6: {}; header bits {}, EOB bits {}, pad bits {}.",
            if ms.is_empty() {
                "none".to_string()
            } else {
                ms.join(", ")
            },
            a.header_bits,
            a.eob_bits,
            a.pad_bits
        );
    }

    // 3. Self-describing stand-in ------------------------------------------------------
    println!(
        "\n## 3. The same values in a self-describing encoding (stand-in for the reference)\n"
    );
    println!(
        "JSON with the reference's field names: a format that carries names per field, as the \
         reference's 194 B / 178 B serialisation probably did (its sizes fit that). Compressed \
         with the same zlib (level 6).\n"
    );
    let json_req = r#"{"systemId":"PL","appVersion":"qq.qq.qq","companyId":"12","sourceIp":"DESKTOP-NDOHT79","destIp":"DESKTOP-NDOHT79","spiderOpts":{},"companyName":"機構1","createDate":"20160101","companyType":1}"#;
    let node =
        r#"{"nodeId":100001,"nodeName":"機構100001","companyId":"1200","createDate":"20160101"}"#;
    let json_rep = format!(r#"{{"nodes":[{node},{node}]}}"#);
    println!("| encoding | request B → zlib B | reply B → zlib B |");
    println!("|---|---|---|");
    let cell = |b: &[u8]| {
        let z = zlib(b, 6, 15);
        format!("{} → {} ({})", b.len(), z.len(), saving(b.len(), z.len()))
    };
    println!("| reference report (published) | 194 → 120 (-38 %) | 178 → 110 (-38 %) |");
    println!(
        "| JSON, same fields and values | {} | {} |",
        cell(json_req.as_bytes()),
        cell(json_rep.as_bytes())
    );
    println!(
        "| protobuf app message | {} | {} |",
        cell(&preq.app),
        cell(&prep.app)
    );
    println!(
        "| protobuf envelope (what rpcmesh compresses) | {} | {} |",
        cell(&preq.envelope),
        cell(&prep.envelope)
    );

    // 4. Frames ------------------------------------------------------------------------
    println!("\n## 4. What compression can touch: the whole frame\n");
    println!(
        "Frame = 18 B header + names (request) / status (reply) + 4 B payload length + envelope \
         + 4 B CRC32. Only the envelope is compressed. \"default\" = what `CallCodec` writes \
         with level {DEFAULT_COMPRESS_LEVEL}, threshold {DEFAULT_COMPRESS_THRESHOLD}.\n"
    );
    println!(
        "| message | frame B | header | names/status | len field | CRC | envelope (compressible) | frame with default compression | saved |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut call_plain = 0;
    let mut call_default = 0;
    let mut call_env = 0;
    for p in all {
        let f = p.parts;
        assert_eq!(
            f.header + f.prefix + f.len_field + p.envelope.len() + f.crc,
            p.frame_plain
        );
        if std::ptr::eq(p, &preq) || std::ptr::eq(p, &prep) {
            call_plain += p.frame_plain;
            call_default += p.frame_default;
            call_env += p.envelope.len();
        }
        println!(
            "| {} | {} | {} | {} | {} | {} | {} ({}) | {} | {} |",
            p.name,
            p.frame_plain,
            f.header,
            f.prefix,
            f.len_field,
            f.crc,
            p.envelope.len(),
            pct(p.envelope.len() as f64, p.frame_plain as f64),
            p.frame_default,
            saving(p.frame_plain, p.frame_default)
        );
    }
    println!(
        "| **platform call, both ways** | {call_plain} | | | | | {call_env} ({}) | {call_default} | {} |",
        pct(call_env as f64, call_plain as f64),
        saving(call_plain, call_default)
    );

    // 5. Times per level ---------------------------------------------------------------
    println!("\n## 5. Time per message, rpcmesh_wire::compress (reset per message)\n");
    println!(
        "`Compressor::compress_into` (threshold forced to 1) and `Inflater::inflate_into`, one \
         warm state reused, as a connection does.\n"
    );
    println!(
        "| payload | {} |",
        lv(&|l| format!("L{l} compress | L{l} inflate")).join(" | ")
    );
    println!("|---|{}", "---:|".repeat(2 * levels.len()));
    let mut times = std::collections::HashMap::new();
    for p in timed {
        let mut cells = Vec::new();
        for &l in &levels {
            let (c, i) = time_wire(plan, &mut sp, &p.envelope, l);
            times.insert((p.name, l), (c, i));
            cells.push(format!("{c:.0} | {i:.0}"));
        }
        println!("| {} | {} |", p.name, cells.join(" | "));
    }
    let l6: std::collections::HashMap<&str, (f64, f64)> = times
        .iter()
        .filter(|((_, l), _)| *l == 6)
        .map(|((n, _), t)| (*n, *t))
        .collect();

    println!(
        "\n### 5b. Does it pay? Bytes saved per message against CPU added (compress + inflate)\n"
    );
    println!(
        "Break-even link speed = bytes saved × 8 / CPU time added: on a faster link the CPU \
         costs more time than the bytes it saves (ignoring that the CPU is also the \
         throughput limit on a busy host).\n"
    );
    println!(
        "| payload | {} |",
        lv(&|l| format!("L{l} saved B | L{l} CPU µs | L{l} break-even Mbit/s")).join(" | ")
    );
    println!("|---|{}", "---:|".repeat(3 * levels.len()));
    for p in timed {
        let env = &p.envelope[..];
        let cells = lv(&|l| {
            let zl = zlib(env, l, 15).len();
            let saved = env.len().saturating_sub(zl);
            let (c, i) = times[&(p.name, l)];
            format!(
                "{saved} | {:.1} | {:.0}",
                (c + i) / 1000.0,
                saved as f64 * 8.0 / (c + i) * 1000.0
            )
        });
        println!("| {} | {} |", p.name, cells.join(" | "));
    }

    // 6. reset() vs new ----------------------------------------------------------------
    println!("\n## 6. What a compression costs: reset() alone, deflate proper, a fresh state\n");
    let env = &preq.envelope[..];
    let z = zlib(env, 6, 15);
    let mut out = vec![0u8; env.len() + 64];
    let fresh_ops = (plan.ops / 10).max(1);
    let mut rows: Vec<(String, f64)> = Vec::new();
    for wb in [15u8, 9] {
        let mut c = Compress::new_with_window_bits(Compression::new(6), true, wb);
        let t = median_ns(plan, plan.ops, &mut sp, || {
            c.reset();
            black_box(&c);
        });
        rows.push((format!("`Compress::reset()` alone (window {wb})"), t));
    }
    let mut c1 = Compress::new(Compression::new(1), true);
    let t = median_ns(plan, plan.ops, &mut sp, || {
        c1.reset();
        black_box(&c1);
    });
    rows.push(("`Compress::reset()` alone (level 1)".into(), t));
    let mut head = vec![1u16; 65536];
    let t = median_ns(plan, plan.ops, &mut sp, || {
        black_box(&mut head[..]).fill(0);
        black_box(&head);
    });
    rows.push((
        "for scale: zero 128 KiB (`[u16; 65536]`, zlib-rs's hash head table)".into(),
        t,
    ));
    let t = median_ns(plan, plan.ops, &mut sp, || {
        c1.reset();
        let st = c1
            .compress(black_box(env), &mut out, FlushCompress::Finish)
            .expect("deflates");
        black_box(st);
    });
    rows.push(("reset() + compress (platform request, L1)".into(), t));
    let mut c = Compress::new(Compression::new(6), true);
    let t_rc = median_ns(plan, plan.ops, &mut sp, || {
        c.reset();
        let st = c
            .compress(black_box(env), &mut out, FlushCompress::Finish)
            .expect("deflates");
        black_box(st);
    });
    rows.push(("reset() + compress (platform request, L6)".into(), t_rc));
    let t_new = median_ns(plan, fresh_ops, &mut sp, || {
        black_box(Compress::new(Compression::new(6), true));
    });
    rows.push(("`Compress::new` + drop, no data".into(), t_new));
    let t_fresh = median_ns(plan, fresh_ops, &mut sp, || {
        let mut c = Compress::new(Compression::new(6), true);
        let st = c
            .compress(black_box(env), &mut out, FlushCompress::Finish)
            .expect("deflates");
        black_box(st);
    });
    rows.push((
        "fresh `Compress::new` + compress + drop (platform request, L6)".into(),
        t_fresh,
    ));
    let mut d = Decompress::new(true);
    let mut dout = vec![0u8; env.len() + 64];
    let t_dr = median_ns(plan, plan.ops, &mut sp, || {
        d.reset(true);
        black_box(&d);
    });
    rows.push(("`Decompress::reset(true)` alone".into(), t_dr));
    let t_drd = median_ns(plan, plan.ops, &mut sp, || {
        d.reset(true);
        let st = d
            .decompress(black_box(&z), &mut dout, FlushDecompress::Finish)
            .expect("inflates");
        black_box(st);
    });
    rows.push(("reset(true) + inflate (platform request)".into(), t_drd));
    let t_dfresh = median_ns(plan, fresh_ops, &mut sp, || {
        let mut d = Decompress::new(true);
        let st = d
            .decompress(black_box(&z), &mut dout, FlushDecompress::Finish)
            .expect("inflates");
        black_box(st);
    });
    rows.push((
        "fresh `Decompress::new` + inflate + drop (platform request)".into(),
        t_dfresh,
    ));
    // Many connections: each has its own ~370 KiB state, so states fall out of cache.
    for (n, wb) in [(16usize, 15u8), (64, 15), (64, 9)] {
        let mut cs: Vec<Compress> = (0..n)
            .map(|_| Compress::new_with_window_bits(Compression::new(6), true, wb))
            .collect();
        let mut k = 0;
        let t = median_ns(plan, plan.ops, &mut sp, || {
            let c = &mut cs[k % n];
            k += 1;
            c.reset();
            let st = c
                .compress(black_box(env), &mut out, FlushCompress::Finish)
                .expect("deflates");
            black_box(st);
        });
        rows.push((
            format!(
                "reset() + compress (platform request, L6), {n} states round-robin (≈ {n} \
                 connections), window {wb}"
            ),
            t,
        ));
    }
    println!("| operation | ns |");
    println!("|---|---:|");
    for (what, t) in &rows {
        println!("| {what} | {t:.0} |");
    }
    println!(
        "\nDeflate proper (reset + compress − reset) for the platform request, L6: ≈ {:.0} ns.",
        t_rc - rows[0].1
    );

    // 7. Window bits -------------------------------------------------------------------
    println!("\n## 7. Window bits 9..15 (level 6, `Compress::new_with_window_bits`)\n");
    println!(
        "Inflated by a standard 15-bit `Decompress::new(true)` (a smaller window is always \
         readable by a default inflater). CMF = first zlib header byte (window in its high \
         nibble). Time = reset + compress.\n"
    );
    println!(
        "| window bits | CMF | deflate state KiB | platform req B | ns | platform reply B | ns | echo 1 KiB req B | ns | synthetic 1 KiB reply B | ns | inflate platform reply ns |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for wb in 9u8..=15 {
        let mut cells = Vec::new();
        let mut cmf = 0u8;
        let mut reply_z = Vec::new();
        for p in [&preq, &prep, &e1k, &syn] {
            let env = &p.envelope[..];
            let z = zlib(env, 6, wb);
            cmf = z[0];
            // interop: the default inflater reads it
            let mut d = Decompress::new(true);
            let mut o = vec![0u8; env.len() + 16];
            let st = d
                .decompress(&z, &mut o, FlushDecompress::Finish)
                .expect("a 15-bit inflater reads a smaller window");
            assert_eq!(st, Status::StreamEnd);
            assert_eq!(&o[..d.total_out() as usize], env);
            let mut c = Compress::new_with_window_bits(Compression::new(6), true, wb);
            let mut out = vec![0u8; env.len() + 64];
            let t = median_ns(plan, plan.ops, &mut sp, || {
                c.reset();
                let st = c
                    .compress(black_box(env), &mut out, FlushCompress::Finish)
                    .expect("deflates");
                black_box(st);
            });
            if std::ptr::eq(p, &prep) {
                reply_z = z.clone();
            }
            cells.push(format!("{} | {t:.0}", z.len()));
        }
        let mut d = Decompress::new(true);
        let mut o = vec![0u8; prep.envelope.len() + 16];
        let ti = median_ns(plan, plan.ops, &mut sp, || {
            d.reset(true);
            let st = d
                .decompress(black_box(&reply_z), &mut o, FlushDecompress::Finish)
                .expect("inflates");
            black_box(st);
        });
        println!(
            "| {wb} | 0x{cmf:02x} | {} | {} | {ti:.0} |",
            deflate_state_kib(wb),
            cells.join(" | ")
        );
    }

    // 8. Per call ----------------------------------------------------------------------
    println!("\n## 8. Per platform call, in the real encode/decode path (CallCodec)\n");
    println!(
        "One call = driver encodes the request, provider decodes it, provider encodes the \
         reply, driver reads it. Plain vs default compression (level {DEFAULT_COMPRESS_LEVEL}).\n"
    );
    println!("| step | plain ns | compressed ns | added ns |");
    println!("|---|---:|---:|---:|");
    let workload = Workload::new(WorkloadKind::Platform, 0);
    let mut totals = (0.0, 0.0);
    let mut steps: Vec<(&str, f64, f64)> = Vec::new();
    {
        let mut t = [0.0f64; 2];
        let mut fr = [BytesMut::new(), BytesMut::new()];
        for (k, cfg) in [None, Some(CompressionConfig::default())]
            .into_iter()
            .enumerate()
        {
            let mut codec = CallCodec::new(cfg, DEFAULT_MAX_INFLATED_LEN);
            let mut b = BytesMut::with_capacity(4096);
            t[k] = median_ns(plan, plan.ops, &mut sp, || {
                b.clear();
                black_box(
                    workload
                        .encode(&mut codec, &mut b, 7, call_flags())
                        .expect("encodes"),
                );
            });
            fr[k] = b.clone();
        }
        steps.push(("driver: encode request", t[0], t[1]));
        let frames: Vec<Frame> = fr
            .iter()
            .map(|b| Frame::from_bytes(b.clone().freeze()).expect("parses"))
            .collect();
        for (k, f) in frames.iter().enumerate() {
            let mut codec = CallCodec::new(None, DEFAULT_MAX_INFLATED_LEN);
            t[k] = median_ns(plan, plan.ops, &mut sp, || {
                black_box(codec.decode_request(black_box(f)).expect("decodes"));
            });
        }
        steps.push(("provider: decode request", t[0], t[1]));
        let answer = &prep.app;
        for (k, cfg) in [None, Some(CompressionConfig::default())]
            .into_iter()
            .enumerate()
        {
            let mut codec = CallCodec::new(cfg, DEFAULT_MAX_INFLATED_LEN);
            let mut b = BytesMut::with_capacity(4096);
            t[k] = median_ns(plan, plan.ops, &mut sp, || {
                b.clear();
                black_box(
                    codec
                        .put_ok_response(&mut b, 7, call_flags(), black_box(answer))
                        .expect("encodes"),
                );
            });
            fr[k] = b.clone();
        }
        steps.push(("provider: encode reply", t[0], t[1]));
        let frames: Vec<Frame> = fr
            .iter()
            .map(|b| Frame::from_bytes(b.clone().freeze()).expect("parses"))
            .collect();
        for (k, f) in frames.iter().enumerate() {
            let mut codec = CallCodec::new(None, DEFAULT_MAX_INFLATED_LEN);
            t[k] = median_ns(plan, plan.ops, &mut sp, || {
                let v = codec.view_response(black_box(f)).expect("reads");
                black_box(v.payload.len());
            });
        }
        steps.push(("driver: read reply", t[0], t[1]));
    }
    for (what, p, c) in &steps {
        totals.0 += p;
        totals.1 += c;
        println!("| {what} | {p:.0} | {c:.0} | {:+.0} |", c - p);
    }
    println!(
        "| **per call** | **{:.0}** | **{:.0}** | **{:+.0}** |",
        totals.0,
        totals.1,
        totals.1 - totals.0
    );
    let saved_b = call_plain - call_default;
    let added_ns = totals.1 - totals.0;
    println!(
        "\nBytes saved per call: {saved_b} B. Link speed below which that saving outweighs the \
         added CPU (bytes·8 / added time): {:.0} Mbit/s.",
        saved_b as f64 * 8.0 / added_ns * 1000.0
    );
    if let (Some(rq), Some(rp)) = (l6.get(preq.name), l6.get(prep.name)) {
        println!(
            "Compressor/Inflater alone (section 5, L6): 2 compressions + 2 inflations = {:.0} ns \
             per call.",
            rq.0 + rq.1 + rp.0 + rp.1
        );
    }
    println!(
        "\nBatch-to-batch noise: worst (max − min) / median over all measurements = {:.0} %.",
        100.0 * sp.worst
    );
}
