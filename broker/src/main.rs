//! `broker`: validates the command line and runs the library until SIGTERM/SIGINT.

use clap::Parser;

/// The system allocator, counted per thread: `rpcmesh_forwarding_allocations_total` shows
/// that forwarding a call allocates nothing in steady state (`rpcmesh_common::alloc`).
#[global_allocator]
static ALLOCATOR: rpcmesh_common::alloc::Counting = rpcmesh_common::alloc::Counting::system();

fn main() -> anyhow::Result<()> {
    rpcmesh_broker::main_with(&rpcmesh_broker::Args::parse())
}
