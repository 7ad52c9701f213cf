//! Generates the protobuf message types from `proto/*.proto` with a pure-Rust compiler
//! (`protox`), so building rpcmesh needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/rpc.proto", "proto/platform.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    prost_build::Config::new()
        // `bytes` fields become `bytes::Bytes`: decoding from a frame's body slices it
        // instead of copying.
        .bytes(["."])
        .compile_fds(fds)?;
    Ok(())
}
