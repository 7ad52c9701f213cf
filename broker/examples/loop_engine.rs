//! The broker on the loop engine (`rpcmesh_broker::engine`), for the benches and the
//! profile to weigh against the broker on Tokio: it takes the broker's flags, serves
//! `--listen` with the engine until SIGTERM or SIGINT ends the process, and serves no
//! metrics. Not a product: the engine does not yet do all the broker does (its module
//! says what it does), and refuses TLS and a providers file.
//!
//! ```text
//! cargo build --release -p rpcmesh-broker --example loop_engine
//! scripts/profile --no-build --broker target/release/broker \
//!     --broker target/release/examples/loop_engine
//! scripts/bench --no-build --baseline-broker target/release/examples/loop_engine
//! ```

use clap::Parser;
use rpcmesh_broker::Args;

/// The system allocator, counted per thread, as the broker's: the summary printed at the
/// end says what the engine's rounds allocated (`rpcmesh_common::alloc`).
#[global_allocator]
static ALLOCATOR: rpcmesh_common::alloc::Counting = rpcmesh_common::alloc::Counting::system();

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let config = args.config()?;
    let listener = std::net::TcpListener::bind(args.listen)?;
    let handle = rpcmesh_broker::engine::spawn(config, listener)?;
    println!(
        "{}",
        rpcmesh_common::cli::startup::listening_line("loop_engine", handle.local_addr(), None)
    );
    let summary = handle.join()?;
    eprintln!("loop_engine: {summary:?}");
    Ok(())
}
