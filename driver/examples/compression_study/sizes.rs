//! Sections 1 to 4 of the study, sizes only (no timing): what zlib makes of each
//! envelope at each level, where its bytes go, the same values in a self-describing
//! encoding, and how much of a whole frame compression can touch.

use rpcmesh_wire::compress::DEFAULT_COMPRESS_LEVEL;
use rpcmesh_wire::compress::DEFAULT_COMPRESS_THRESHOLD;

use crate::deflate::anatomy;
use crate::timing::{wire_compress, zlib};
use crate::{LEVELS, Study, per_level};

/// Section 1: The envelope's size at levels 1 / 2 / 6 / 9, and what the default config
/// sends.
pub(crate) fn sizes(study: &Study) {
    println!("## 1. Sizes: the envelope zlib is given, at levels 1 / 2 / 6 / 9\n");
    println!(
        "`compress_into` with the threshold forced to 1; \"plain\" = output not shorter, so \
         the code would send it plain. Blocks: F = fixed Huffman, D = dynamic, S = stored.\n"
    );
    println!(
        "| payload | app msg B | envelope B | {} | blocks {} | default config sends |",
        per_level(|l| format!("L{l}")).join(" | "),
        per_level(|l| format!("L{l}")).join("/")
    );
    println!("|---|---:|---:|{}---|---|", "---:|".repeat(LEVELS.len()));
    for p in study.all() {
        let env = &p.envelope[..];
        let mut cells = Vec::new();
        let mut blocks = Vec::new();
        for &l in &LEVELS {
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
}

/// Section 2: Where the zlib bytes go (level 6), and the platform call's envelopes byte by
/// byte.
pub(crate) fn where_the_bytes_go(study: &Study) {
    println!("\n## 2. Where the zlib bytes go (level 6)\n");
    println!(
        "fixed = 2 B zlib header + 4 B Adler-32 + block header bits + end-of-block code + \
         padding: paid by every message whatever its content.\n"
    );
    println!(
        "| payload | plain B | zlib B | fixed B | literals (count → B) | matches (count, bytes covered → B) | fixed share of output |"
    );
    println!("|---|---:|---:|---:|---|---|---:|");
    for p in study.all() {
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
    for p in [&study.preq, &study.prep] {
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
}

/// Section 3: The same values in a self-describing encoding, a stand-in for the
/// reference's.
pub(crate) fn self_describing(study: &Study) {
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
        cell(&study.preq.app),
        cell(&study.prep.app)
    );
    println!(
        "| protobuf envelope (what rpcmesh compresses) | {} | {} |",
        cell(&study.preq.envelope),
        cell(&study.prep.envelope)
    );
}

/// Section 4: What compression can touch: the whole frame. Returns the platform call's
/// frame bytes (both ways), plain and with the default compression.
pub(crate) fn frames(study: &Study) -> (usize, usize) {
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
    for p in study.all() {
        let f = p.parts;
        assert_eq!(
            f.header + f.prefix + f.len_field + p.envelope.len() + f.crc,
            p.frame_plain
        );
        if std::ptr::eq(p, &study.preq) || std::ptr::eq(p, &study.prep) {
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
    (call_plain, call_default)
}

pub(crate) fn pct(part: f64, whole: f64) -> String {
    format!("{:.0} %", 100.0 * part / whole)
}

pub(crate) fn saving(plain: usize, z: usize) -> String {
    format!("{:+.0} %", 100.0 * (z as f64 - plain as f64) / plain as f64)
}

pub(crate) fn size_cell(plain: usize, z: Option<&Vec<u8>>, raw: &[u8]) -> String {
    match z {
        Some(z) => format!("{} ({})", z.len(), saving(plain, z.len())),
        None => format!("plain (zlib: {})", raw.len()),
    }
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter()
        .map(|x| format!("{x:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

pub(crate) fn printable(b: &[u8]) -> String {
    String::from_utf8_lossy(b)
        .chars()
        .map(|c| if c.is_control() { '·' } else { c })
        .collect()
}
