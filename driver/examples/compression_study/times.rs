//! Sections 5 to 8 of the study, timed: compression and inflation per level, what a
//! compression costs (reset alone, deflate proper, a fresh state, many states), window
//! bits, and a whole platform call through the real encode/decode path.

use std::collections::HashMap;
use std::hint::black_box;

use bytes::BytesMut;
use flate2::{Compress, Compression, Decompress, FlushDecompress, Status};
use rpcmesh_driver::WorkloadKind;
use rpcmesh_driver::workload::Workload;
use rpcmesh_wire::compress::{CompressionConfig, DEFAULT_COMPRESS_LEVEL, DEFAULT_MAX_INFLATED_LEN};
use rpcmesh_wire::envelope::CallCodec;
use rpcmesh_wire::frame::Frame;

use crate::payloads::call_flags;
use crate::timing::{Spread, deflate, inflate, median_ns, time_wire, zlib};
use crate::{LEVELS, Study, per_level};

/// Level 6's (compress, inflate) ns per message, by payload name.
pub(crate) type LevelSix = HashMap<&'static str, (f64, f64)>;

/// Section 5: Time per message at each level, and whether it pays. Returns the level-6
/// (compress, inflate) ns by payload name.
pub(crate) fn times_per_level(study: &Study, sp: &mut Spread) -> LevelSix {
    println!("\n## 5. Time per message, rpcmesh_wire::compress (reset per message)\n");
    println!(
        "`Compressor::compress_into` (threshold forced to 1) and `Inflater::inflate_into`, one \
         warm state reused, as a connection does.\n"
    );
    println!(
        "| payload | {} |",
        per_level(|l| format!("L{l} compress | L{l} inflate")).join(" | ")
    );
    println!("|---|{}", "---:|".repeat(2 * LEVELS.len()));
    let mut times = HashMap::new();
    for p in study.timed() {
        let mut cells = Vec::new();
        for &l in &LEVELS {
            let (c, i) = time_wire(study.plan, sp, &p.envelope, l);
            times.insert((p.name, l), (c, i));
            cells.push(format!("{c:.0} | {i:.0}"));
        }
        println!("| {} | {} |", p.name, cells.join(" | "));
    }
    let l6: LevelSix = times
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
        per_level(|l| format!("L{l} saved B | L{l} CPU µs | L{l} break-even Mbit/s")).join(" | ")
    );
    println!("|---|{}", "---:|".repeat(3 * LEVELS.len()));
    for p in study.timed() {
        let env = &p.envelope[..];
        let cells = per_level(|l| {
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
    l6
}

/// Section 6: What a compression costs: reset() alone, deflate proper, a fresh state, many
/// states.
pub(crate) fn reset_against_new(study: &Study, sp: &mut Spread) {
    println!("\n## 6. What a compression costs: reset() alone, deflate proper, a fresh state\n");
    let env = &study.preq.envelope[..];
    let z = zlib(env, 6, 15);
    let mut out = vec![0u8; env.len() + 64];
    let fresh_ops = (study.plan.ops / 10).max(1);
    let mut rows: Vec<(String, f64)> = Vec::new();
    for wb in [15u8, 9] {
        let mut c = Compress::new_with_window_bits(Compression::new(6), true, wb);
        let t = median_ns(study.plan, study.plan.ops, sp, || {
            c.reset();
            black_box(&c);
        });
        rows.push((format!("`Compress::reset()` alone (window {wb})"), t));
    }
    let mut c1 = Compress::new(Compression::new(1), true);
    let t = median_ns(study.plan, study.plan.ops, sp, || {
        c1.reset();
        black_box(&c1);
    });
    rows.push(("`Compress::reset()` alone (level 1)".into(), t));
    let mut head = vec![1u16; 65536];
    let t = median_ns(study.plan, study.plan.ops, sp, || {
        black_box(&mut head[..]).fill(0);
        black_box(&head);
    });
    rows.push((
        "for scale: zero 128 KiB (`[u16; 65536]`, zlib-rs's hash head table)".into(),
        t,
    ));
    let t = median_ns(study.plan, study.plan.ops, sp, || {
        c1.reset();
        deflate(&mut c1, env, &mut out);
    });
    rows.push(("reset() + compress (platform request, L1)".into(), t));
    let mut c = Compress::new(Compression::new(6), true);
    let t_rc = median_ns(study.plan, study.plan.ops, sp, || {
        c.reset();
        deflate(&mut c, env, &mut out);
    });
    rows.push(("reset() + compress (platform request, L6)".into(), t_rc));
    let t_new = median_ns(study.plan, fresh_ops, sp, || {
        black_box(Compress::new(Compression::new(6), true));
    });
    rows.push(("`Compress::new` + drop, no data".into(), t_new));
    let t_fresh = median_ns(study.plan, fresh_ops, sp, || {
        let mut c = Compress::new(Compression::new(6), true);
        deflate(&mut c, env, &mut out);
    });
    rows.push((
        "fresh `Compress::new` + compress + drop (platform request, L6)".into(),
        t_fresh,
    ));
    let mut d = Decompress::new(true);
    let mut dout = vec![0u8; env.len() + 64];
    let t_dr = median_ns(study.plan, study.plan.ops, sp, || {
        d.reset(true);
        black_box(&d);
    });
    rows.push(("`Decompress::reset(true)` alone".into(), t_dr));
    let t_drd = median_ns(study.plan, study.plan.ops, sp, || {
        d.reset(true);
        inflate(&mut d, &z, &mut dout);
    });
    rows.push(("reset(true) + inflate (platform request)".into(), t_drd));
    let t_dfresh = median_ns(study.plan, fresh_ops, sp, || {
        let mut d = Decompress::new(true);
        inflate(&mut d, &z, &mut dout);
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
        let t = median_ns(study.plan, study.plan.ops, sp, || {
            let c = &mut cs[k % n];
            k += 1;
            c.reset();
            deflate(c, env, &mut out);
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
}

/// Section 7: Window bits 9..15 at level 6: sizes, times, and that a default inflater reads
/// them.
pub(crate) fn window_bits(study: &Study, sp: &mut Spread) {
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
        for p in [&study.preq, &study.prep, &study.e1k, &study.syn] {
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
            let t = median_ns(study.plan, study.plan.ops, sp, || {
                c.reset();
                deflate(&mut c, env, &mut out);
            });
            if std::ptr::eq(p, &study.prep) {
                reply_z = z.clone();
            }
            cells.push(format!("{} | {t:.0}", z.len()));
        }
        let mut d = Decompress::new(true);
        let mut o = vec![0u8; study.prep.envelope.len() + 16];
        let ti = median_ns(study.plan, study.plan.ops, sp, || {
            d.reset(true);
            inflate(&mut d, &reply_z, &mut o);
        });
        println!(
            "| {wb} | 0x{cmf:02x} | {} | {} | {ti:.0} |",
            deflate_state_kib(wb),
            cells.join(" | ")
        );
    }
}

/// Section 8: One platform call through the real encode/decode path, plain against
/// compressed; `frames` is section 4's, `l6` section 5's.
pub(crate) fn per_call(
    study: &Study,
    sp: &mut Spread,
    (call_plain, call_default): (usize, usize),
    l6: &LevelSix,
) {
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
    let (t, requests) = time_encode(study, sp, |codec, b| {
        black_box(
            workload
                .encode(codec, b, 7, call_flags(), &[])
                .expect("encodes"),
        );
    });
    steps.push(("driver: encode request", t[0], t[1]));
    let t = time_decode(study, sp, &requests, |codec, f| {
        black_box(codec.decode_request(black_box(f)).expect("decodes"));
    });
    steps.push(("provider: decode request", t[0], t[1]));
    let answer = &study.prep.app;
    let (t, replies) = time_encode(study, sp, |codec, b| {
        black_box(
            codec
                .put_ok_response(b, 7, call_flags(), black_box(answer))
                .expect("encodes"),
        );
    });
    steps.push(("provider: encode reply", t[0], t[1]));
    let t = time_decode(study, sp, &replies, |codec, f| {
        let v = codec.view_response(black_box(f)).expect("reads");
        black_box(v.payload.len());
    });
    steps.push(("driver: read reply", t[0], t[1]));
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
    if let (Some(rq), Some(rp)) = (l6.get(study.preq.name), l6.get(study.prep.name)) {
        println!(
            "Compressor/Inflater alone (section 5, L6): 2 compressions + 2 inflations = {:.0} ns \
             per call.",
            rq.0 + rq.1 + rp.0 + rp.1
        );
    }
}

/// Median ns of `encode` writing one frame into a cleared buffer, with a codec plain and
/// one with default compression (in that order), and the frame each wrote.
fn time_encode(
    study: &Study,
    sp: &mut Spread,
    mut encode: impl FnMut(&mut CallCodec, &mut BytesMut),
) -> ([f64; 2], [Frame; 2]) {
    let mut t = [0.0f64; 2];
    let mut written = [BytesMut::new(), BytesMut::new()];
    for (k, cfg) in [None, Some(CompressionConfig::default())]
        .into_iter()
        .enumerate()
    {
        let mut codec = CallCodec::new(cfg, DEFAULT_MAX_INFLATED_LEN);
        let mut b = BytesMut::with_capacity(4096);
        t[k] = median_ns(study.plan, study.plan.ops, sp, || {
            b.clear();
            encode(&mut codec, &mut b);
        });
        written[k] = b;
    }
    let frames = written.map(|b| Frame::from_bytes(b.freeze()).expect("parses"));
    (t, frames)
}

/// Median ns of `read` reading each of `frames` (plain, then compressed) with a plain
/// codec, as the receiving side's is.
fn time_decode(
    study: &Study,
    sp: &mut Spread,
    frames: &[Frame; 2],
    mut read: impl FnMut(&mut CallCodec, &Frame),
) -> [f64; 2] {
    let mut t = [0.0f64; 2];
    for (k, f) in frames.iter().enumerate() {
        let mut codec = CallCodec::new(None, DEFAULT_MAX_INFLATED_LEN);
        t[k] = median_ns(study.plan, study.plan.ops, sp, || read(&mut codec, f));
    }
    t
}

/// Approximate zlib-rs deflate state for a window (see `DeflateAllocOffsets` in zlib-rs:
/// window 2·2^w, prev 2·2^w, head 2·65536, pending 4·16384, symbols 3·16384), in KiB.
pub(crate) fn deflate_state_kib(window_bits: u8) -> usize {
    let w = 1usize << window_bits;
    (2 * w + 2 * w + 2 * 65536 + 4 * 16384 + 3 * 16384) / 1024
}
