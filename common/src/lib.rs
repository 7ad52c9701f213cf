//! rpcmesh's shared plumbing above the wire protocol. Three layers, each using only those
//! below it (the wire layer is the crate `rpcmesh-wire`, in `common/wire/`):
//!
//! ```text
//!   cli       flags and values every program takes, config problems, start-up, systemd
//!   format    figures as people read them (ms, thousands, bytes): pure, for every report
//!   log_sink  where log lines go: a bounded queue and a thread writing it to stderr
//!             (never blocks or fails the process; a leaf, used by cli, read by metrics)
//!   alloc     the counting allocator a program may install, and tasks whose allocations
//!             are counted: a leaf
//!   build     this build's version, git commit and profile (from build.rs): pure
//!   authz     the authorization policy: who may call what, who may forward identities
//!   retry     the retry budget: a share of the calls plus a floor a second (a leaf)
//!   metrics   the catalogue of metrics, the recorder, handle groups, errors, /proc
//!   net       framed connections, accept loop, server-session skeleton, slot table,
//!             busy polling, a small client, shutdown
//!   ─────────
//!   wire      (rpcmesh-wire) frames, bodies, stream codec, envelope, compression,
//!             statuses, protobuf: pure
//! ```
//!
//! The test `layers_use_only_the_layers_below` holds the rule for the modules of this
//! crate; `rpcmesh-wire`'s `Cargo.toml`, which has no runtime or metrics dependency, holds
//! it for the wire layer. What the programs' black-box tests share is the crate
//! `rpcmesh-testkit` (`testkit/`), never compiled into this one.

pub mod alloc;
pub mod authz;
pub mod build;
pub mod cli;
pub mod files;
pub mod format;
pub mod log_sink;
pub mod metrics;
pub mod net;
pub mod retry;

#[cfg(test)]
mod layering {
    use std::path::Path;

    /// Every `.rs` file under `dir`, with its text.
    fn sources(dir: &Path) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(dir).expect("read the source folder") {
            let path = entry.expect("a folder entry").path();
            if path.is_dir() {
                out.extend(sources(&path));
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("read a source file");
                out.push((path.display().to_string(), text));
            }
        }
        out
    }

    /// The code of a file, without its comments (which may name other layers).
    fn code(text: &str) -> String {
        text.lines()
            .map(|l| l.split("//").next().unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn layers_use_only_the_layers_below() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        // (layer, what it must not use); `metrics::` in net is the metrics crate or layer.
        let rules: [(&str, &[&str]); 2] = [
            ("net", &["crate::metrics", "crate::cli", "metrics::"]),
            ("metrics", &["crate::cli"]),
        ];
        // authz is one file: it uses net (identities) only, neither metrics nor cli.
        let authz = code(&std::fs::read_to_string(src.join("authz.rs")).expect("authz.rs"));
        for b in ["crate::metrics", "crate::cli"] {
            assert!(!authz.contains(b), "authz uses {b}");
        }
        for (layer, banned) in rules {
            for (path, text) in sources(&src.join(layer)) {
                let code = code(&text);
                for b in banned {
                    assert!(!code.contains(b), "{path} (layer {layer}) uses {b}");
                }
            }
        }
    }

    /// `docs/architecture.md` names every module of the workspace (a crate's `lib.rs` and a
    /// program's `main.rs` stand for the crate, and are described where it is).
    #[test]
    fn the_architecture_doc_lists_every_module() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let doc = std::fs::read_to_string(root.join("docs/architecture.md"))
            .expect("docs/architecture.md");
        for dir in [
            "common/wire/src",
            "common/src",
            "provider/src",
            "broker/src",
            "driver/src",
            "capacity/src",
            "testkit/src",
            "system-tests/src",
        ] {
            for (path, _) in sources(&root.join(dir)) {
                let rel = path
                    .split("/../")
                    .nth(1)
                    .expect("a path under the workspace")
                    .to_string();
                if rel.ends_with("/lib.rs") || rel.ends_with("/main.rs") {
                    continue;
                }
                assert!(
                    doc.contains(&format!("`{rel}`")),
                    "docs/architecture.md does not list {rel}"
                );
            }
        }
    }

    #[test]
    fn the_wire_layer_is_pure() {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("wire/Cargo.toml");
        let text = std::fs::read_to_string(manifest).expect("common/wire/Cargo.toml");
        let deps = text
            .split("[dependencies]")
            .nth(1)
            .and_then(|rest| rest.split("\n[").next())
            .expect("a [dependencies] table");
        let names: Vec<&str> = deps
            .lines()
            .filter_map(|l| l.split(['.', '=', ' ']).next())
            .filter(|n| !n.is_empty() && !n.starts_with('#'))
            .collect();
        assert_eq!(
            names,
            ["bytes", "crc32fast", "flate2", "prost", "thiserror"],
            "the wire layer depends on nothing that does I/O, schedules or measures"
        );
    }
}
