//! Compression study: what zlib does to rpcmesh's payloads, byte by byte and nanosecond by
//! nanosecond, and why the reference workload saves so little.
//!
//! ```text
//! cargo run --release --example compression_study -p rpcmesh-driver            # 100k ops x 5 batches
//! cargo run --release --example compression_study -p rpcmesh-driver -- --quick # 10k ops x 3 batches
//! cargo run --release --example compression_study -p rpcmesh-driver -- --ops 50000 --batches 7
//! ```
//!
//! It sits with the driver, not the capacity planner, because it measures the driver's and
//! the provider's own encoders. It needs `flate2` as a dev-dependency of the driver
//! (`flate2.workspace = true` under `[dev-dependencies]` in `driver/Cargo.toml`), for the
//! window-bits and reset-vs-new measurements that `rpcmesh_wire::compress` does not expose.
//!
//! The payloads are the real ones ([`payloads`]). What zlib sees is what `compress_into`
//! sees: the protobuf envelope (`rpc.RpcRequest` / `rpc.RpcResponse` around the
//! application message), not the frame.
//!
//! Sizes and times at levels 1/2/6/9 use `rpcmesh_wire::compress::{Compressor, Inflater}`
//! themselves (reset per message, as a connection does). Window bits, `reset()` alone and
//! a fresh `Compress::new` per message use `flate2` directly, with the same settings (zlib
//! header on, level as given) ([`timing`]). Every zlib stream is also taken apart by a
//! small deflate parser ([`deflate`]). Sections 1 to 4 are sizes ([`sizes`]), 5 to 8
//! times ([`times`]).
//!
//! Output: Markdown tables on stdout.

mod deflate;
mod payloads;
mod sizes;
mod times;
mod timing;

use rpcmesh_driver::WorkloadKind;
use rpcmesh_wire::compress::{DEFAULT_COMPRESS_LEVEL, DEFAULT_COMPRESS_THRESHOLD};

use crate::payloads::{Payload, call_payloads, reply_payload, synthetic_answer};
use crate::timing::{Plan, Spread};

/// The zlib levels every table compares: the fastest, the two below the default, the
/// default and the best.
const LEVELS: [u32; 4] = [1, 2, 6, 9];

/// `f` of each of [`LEVELS`], for a table row.
fn per_level(f: impl Fn(u32) -> String) -> Vec<String> {
    LEVELS.iter().map(|&l| f(l)).collect()
}

/// The payloads measured, and how long each measurement runs.
struct Study {
    plan: Plan,
    preq: Payload,
    prep: Payload,
    e32: Payload,
    e32r: Payload,
    e1k: Payload,
    e1kr: Payload,
    syn: Payload,
}

impl Study {
    /// Every payload, for the size tables.
    fn all(&self) -> [&Payload; 7] {
        [
            &self.preq, &self.prep, &self.e32, &self.e32r, &self.e1k, &self.e1kr, &self.syn,
        ]
    }

    /// The payloads that are timed.
    fn timed(&self) -> [&Payload; 5] {
        [&self.preq, &self.prep, &self.e32, &self.e1k, &self.syn]
    }
}

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
    let study = Study {
        plan,
        preq,
        prep,
        e32,
        e32r,
        e1k,
        e1kr,
        syn,
    };

    println!("# rpcmesh compression study\n");
    println!(
        "zlib via flate2 (zlib-rs backend). Defaults: level {DEFAULT_COMPRESS_LEVEL}, threshold \
         {DEFAULT_COMPRESS_THRESHOLD} B. Times: median of {} batches of {} ops (warm state, \
         one connection), ns per op.\n",
        plan.batches, plan.ops
    );
    sizes::sizes(&study);
    sizes::where_the_bytes_go(&study);
    sizes::self_describing(&study);
    let frames = sizes::frames(&study);
    let l6 = times::times_per_level(&study, &mut sp);
    times::reset_against_new(&study, &mut sp);
    times::window_bits(&study, &mut sp);
    times::per_call(&study, &mut sp, frames, &l6);
    println!(
        "\nBatch-to-batch noise: worst (max − min) / median over all measurements = {:.0} %.",
        100.0 * sp.worst
    );
}
