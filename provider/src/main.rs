//! `provider`: validates the command line and runs the library until SIGTERM/SIGINT.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    rpcmesh_provider::main_with(&rpcmesh_provider::Args::parse())
}
