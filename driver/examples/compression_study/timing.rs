//! How the study measures and compresses: the median time per operation over batches
//! (and the worst batch-to-batch spread, reported as the noise), zlib through
//! `rpcmesh_wire::compress` as a connection does it, and through flate2 directly for what
//! the wire layer does not expose (window bits, any level).

use std::hint::black_box;
use std::time::Instant;

use bytes::BytesMut;
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};
use rpcmesh_wire::compress::{CompressionConfig, Compressor, DEFAULT_MAX_INFLATED_LEN, Inflater};

#[derive(Clone, Copy)]
pub(crate) struct Plan {
    pub(crate) ops: usize,
    pub(crate) batches: usize,
}

/// Median ns per op over `plan.batches` batches of `ops` calls (after a warm-up batch of
/// a tenth).
pub(crate) fn median_ns(plan: Plan, ops: usize, spread: &mut Spread, mut f: impl FnMut()) -> f64 {
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
pub(crate) struct Spread {
    pub(crate) worst: f64,
}

/// The zlib stream `Compressor::compress_into` makes of `input` (threshold forced to 1 so
/// that small payloads are tried too), or `None` when it would go plain (no gain).
pub(crate) fn wire_compress(input: &[u8], level: u32) -> Option<Vec<u8>> {
    let mut c = Compressor::new(CompressionConfig {
        threshold: 1,
        level,
    });
    let mut dst = BytesMut::new();
    c.compress_into(input, &mut dst).then(|| dst.to_vec())
}

/// Any zlib stream of `input` (even a longer one), via flate2 with the same settings.
pub(crate) fn zlib(input: &[u8], level: u32, window_bits: u8) -> Vec<u8> {
    let mut c = Compress::new_with_window_bits(Compression::new(level), true, window_bits);
    let mut out = vec![0u8; input.len() + 64];
    let st = c
        .compress(input, &mut out, FlushCompress::Finish)
        .expect("deflate works");
    assert_eq!(st, Status::StreamEnd);
    out.truncate(c.total_out() as usize);
    out
}

/// Compresses all of `input` into `out` with `c` (reset it first to use it again), the
/// result kept from the optimiser: the deflate the study times.
pub(crate) fn deflate(c: &mut Compress, input: &[u8], out: &mut [u8]) {
    let st = c
        .compress(black_box(input), out, FlushCompress::Finish)
        .expect("deflates");
    black_box(st);
}

/// Inflates all of the zlib stream `z` into `out` with `d` (reset it first to use it
/// again), the result kept from the optimiser: the inflate the study times.
pub(crate) fn inflate(d: &mut Decompress, z: &[u8], out: &mut [u8]) {
    let st = d
        .decompress(black_box(z), out, FlushDecompress::Finish)
        .expect("inflates");
    black_box(st);
}

/// ns per `compress_into` (reset + deflate + buffer handling), and per `inflate_into`.
pub(crate) fn time_wire(plan: Plan, sp: &mut Spread, input: &[u8], level: u32) -> (f64, f64) {
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
