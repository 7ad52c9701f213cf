//! Hot paths of the wire layer, measured with criterion: frame encode and decode, CRC32,
//! the header rewrite a broker does when it forwards a frame, and compress / inflate of the
//! reference workload's payloads.
//!
//! `cargo bench -p rpcmesh-common` runs them (the HTML report lands in
//! `target/criterion/`).

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::LazyLock;

use bytes::{Bytes, BytesMut};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use prost::Message;
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::compress::{CompressionConfig, Compressor, Inflater};
use rpcmesh_wire::envelope::CallCodec;
use rpcmesh_wire::frame::{Flags, Header, MsgType, put_forwarded_response, put_frame};
use rpcmesh_wire::proto::platform::QueryRequest;
use rpcmesh_wire::proto::rpc::{EchoRequest, RpcResponse};

fn query() -> QueryRequest {
    rpcmesh_wire::proto::platform::reference_query()
}

fn answer() -> Vec<u8> {
    RpcResponse {
        success: true,
        payload: rpcmesh_wire::proto::platform::reference_answer()
            .encode_to_vec()
            .into(),
        error_msg: String::new(),
    }
    .encode_to_vec()
}

fn echo_32() -> EchoRequest {
    EchoRequest {
        message: "x".repeat(32),
    }
}

/// Puts one request frame for `service`.`method` (no metadata) in `out`, emptied first.
fn put_request(
    codec: &mut CallCodec,
    out: &mut BytesMut,
    service: &[u8],
    method: &[u8],
    msg: &impl Message,
) {
    static NO_METADATA: LazyLock<HashMap<String, String>> = LazyLock::new(HashMap::new);
    out.clear();
    codec
        .put_request(
            out,
            black_box(7),
            Flags::NONE,
            service,
            method,
            msg,
            &NO_METADATA,
        )
        .expect("encodes");
}

fn echo_frame() -> BytesMut {
    let mut b = BytesMut::new();
    let mut codec = CallCodec::new(None, 1 << 20);
    put_request(&mut codec, &mut b, b"EchoService", b"Echo", &echo_32());
    b
}

fn frames(c: &mut Criterion) {
    let mut g = c.benchmark_group("frame");
    g.throughput(Throughput::Elements(1));
    let mut codec = CallCodec::new(None, 1 << 20);
    let mut out = BytesMut::with_capacity(1 << 16);
    let msg = echo_32();
    g.bench_function("encode echo 32 B request", |b| {
        b.iter(|| put_request(&mut codec, &mut out, b"EchoService", b"Echo", &msg))
    });
    let q = query();
    g.bench_function("encode platform request", |b| {
        b.iter(|| put_request(&mut codec, &mut out, b"PlatformService", b"doQuery", &q))
    });
    let one = echo_frame();
    let fc = FrameCodec::default();
    // The buffer's copy is made outside the timing: only the split is measured.
    g.bench_function("decode echo 32 B request frame", |b| {
        b.iter_batched(
            || one.clone(),
            |mut buf| black_box(fc.decode_frame(&mut buf).expect("valid").expect("whole")),
            BatchSize::SmallInput,
        )
    });
    let frame = fc
        .decode_frame(&mut one.clone())
        .expect("valid")
        .expect("whole");
    g.bench_function("decode echo 32 B call (envelope + message)", |b| {
        b.iter(|| {
            let call = codec.decode_request(black_box(&frame)).expect("decodes");
            black_box(EchoRequest::decode(call.rpc.payload).expect("echo"));
        })
    });
    g.finish();
}

fn crc(c: &mut Criterion) {
    let mut g = c.benchmark_group("crc32");
    for size in [64usize, 256, 4096] {
        let data = vec![0x5au8; size];
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(format!("{size} B"), |b| {
            b.iter(|| crc32fast::hash(black_box(&data)))
        });
    }
    g.finish();
}

fn forwarding(c: &mut Criterion) {
    let mut g = c.benchmark_group("forward");
    g.throughput(Throughput::Elements(1));
    let fc = FrameCodec::default();
    let req = fc
        .decode_frame(&mut echo_frame())
        .expect("valid")
        .expect("whole");
    let mut out = BytesMut::with_capacity(1 << 16);
    g.bench_function(
        "rewrite request header (new id, flags) + copy body + CRC",
        |b| {
            let mut id = 0u64;
            b.iter(|| {
                out.clear();
                id += 1;
                let h = Header {
                    msg_type: MsgType::Request,
                    flags: Flags::EXT_STATUS,
                    body_len: req.header.body_len,
                    req_id: id,
                };
                put_frame(&mut out, &h, black_box(&req.body));
            })
        },
    );
    let body: Bytes = {
        let mut b = BytesMut::new();
        b.extend_from_slice(&[0]);
        let a = answer();
        b.extend_from_slice(&(a.len() as u32).to_be_bytes());
        b.extend_from_slice(&a);
        b.freeze()
    };
    g.bench_function("rewrite platform reply to the caller's id + CRC", |b| {
        b.iter(|| {
            out.clear();
            put_forwarded_response(&mut out, black_box(9), Flags::NONE, &body, 0);
        })
    });
    g.finish();
}

fn compression(c: &mut Criterion) {
    let mut g = c.benchmark_group("zlib");
    let request = rpcmesh_wire::proto::rpc::RpcRequest {
        payload: query().encode_to_vec().into(),
        metadata: HashMap::new(),
    }
    .encode_to_vec();
    let reply = answer();
    let mut z = Compressor::new(CompressionConfig {
        threshold: 1,
        level: 6,
    });
    let mut inflater = Inflater::new(1 << 20);
    let mut out = BytesMut::with_capacity(4096);
    for (name, payload) in [("platform request", &request), ("platform reply", &reply)] {
        g.throughput(Throughput::Bytes(payload.len() as u64));
        g.bench_function(format!("compress {name} ({} B)", payload.len()), |b| {
            b.iter(|| {
                out.clear();
                black_box(z.compress_into(black_box(payload), &mut out));
            })
        });
    }
    // The reply is the one that shrinks: inflate its compressed form.
    let mut zipped = BytesMut::new();
    assert!(
        z.compress_into(&reply, &mut zipped),
        "the platform reply compresses"
    );
    g.throughput(Throughput::Bytes(reply.len() as u64));
    g.bench_function(
        format!(
            "inflate platform reply ({} → {} B)",
            zipped.len(),
            reply.len()
        ),
        |b| {
            b.iter(|| {
                out.clear();
                inflater
                    .inflate_into(black_box(&zipped), &mut out)
                    .expect("inflates");
            })
        },
    );
    g.finish();
}

criterion_group!(benches, frames, crc, forwarding, compression);
criterion_main!(benches);
