//! `broker`: validates the command line and runs the library until SIGTERM/SIGINT.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    rpcmesh_broker::main_with(&rpcmesh_broker::Args::parse())
}
