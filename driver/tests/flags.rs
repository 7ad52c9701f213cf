//! The programs' flags as a user meets them: every flag the docs name exists in the
//! program's `--help`, and every flag of every program (the provider, the broker, the
//! driver, `driver capacity`, `driver merge`) has its `RPCMESH_…` environment fallback; and
//! the environment's lists are read as documented.
//!
//! Which flags the docs name, and whose:
//!
//! - The docs are `README.md` and `docs/**/*.md`, but for `docs/log/`: the dated records
//!   of past runs keep the command lines of their day.
//! - A flag is a word that begins with `--` and a letter or digit, in a backticked span or
//!   on a line of a fenced code block (a line that ends in `\` goes on on the next; what
//!   follows a `#` there is a comment).
//! - A span or line that begins with a program (`provider`, `broker`, `driver`,
//!   `driver capacity`, `driver merge`, also as a path such as `target/release/driver`)
//!   is that program's command: each of its flags must be in that program's `--help`.
//! - One that begins with another command is not a program's: a script of the repository
//!   (`scripts/…`, `deploy/…`, `.ci/…`, whose flags are its own: `scripts/bench --smoke`,
//!   `deploy/rehearse --image`), or any other word followed by flags (`cargo test
//!   --test …`, `systemctl disable --now …`).
//! - One that begins with a flag belongs to the last command named before it in the same
//!   file: if that is a script or another tool (the rows of a script's table of options),
//!   it is not checked; otherwise the flag must be in some program's `--help` (prose names
//!   a broker's flag beside a driver's command, and the rule does not guess which).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use rpcmesh_driver::Report;
use rpcmesh_testkit::{self as testkit, InProcess};

/// The programs a doc may name, as their command lines begin.
const PROGRAMS: [&str; 5] = [
    "provider",
    "broker",
    "driver",
    "driver capacity",
    "driver merge",
];

/// Flags every program has from clap itself, without a fallback.
const CLAP_OWN: [&str; 2] = ["--help", "--version"];

/// One flag as `--help` shows it: its name and the text under it.
#[derive(Debug)]
struct HelpFlag {
    name: String,
    text: String,
}

/// The `--help` of `program` (one of [`PROGRAMS`]).
fn help(program: &str) -> String {
    let mut words = program.split(' ');
    let bin = match words.next().unwrap() {
        "driver" => PathBuf::from(env!("CARGO_BIN_EXE_driver")),
        other => testkit::bin_path(other),
    };
    let out = Command::new(bin)
        .args(words)
        .arg("--help")
        .env_remove("RPCMESH_TARGETS")
        .output()
        .unwrap();
    assert!(out.status.success(), "{program} --help failed");
    String::from_utf8(out.stdout).unwrap()
}

/// The flags of a `--help` text: a line indented by at most six spaces that begins with
/// `--NAME` (or `-x, --NAME`) opens one; the lines up to the next belong to it.
fn flags_of(help: &str) -> Vec<HelpFlag> {
    let mut flags: Vec<HelpFlag> = Vec::new();
    for line in help.lines() {
        let indent = line.len() - line.trim_start().len();
        let rest = line.trim_start();
        let rest = match rest.as_bytes() {
            [b'-', c, b',', b' ', ..] if c.is_ascii_alphabetic() => &rest[4..],
            _ => rest,
        };
        match flag_name(rest) {
            Some(name) if (1..=6).contains(&indent) => flags.push(HelpFlag {
                name: name.to_string(),
                text: line.to_string(),
            }),
            _ => {
                if let Some(f) = flags.last_mut() {
                    f.text.push('\n');
                    f.text.push_str(line);
                }
            }
        }
    }
    flags
}

/// The flag a word begins with (`--name`, up to the first character a flag's name does
/// not have), if it begins with one.
fn flag_name(word: &str) -> Option<&str> {
    let rest = word.strip_prefix("--")?;
    if !rest.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return None;
    }
    let len = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .unwrap_or(rest.len());
    Some(&word[..2 + len])
}

/// Every program's flags, by program.
fn programs() -> BTreeMap<&'static str, Vec<HelpFlag>> {
    PROGRAMS.iter().map(|p| (*p, flags_of(&help(p)))).collect()
}

/// Whose a span or command line is, by how it begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    /// One of [`PROGRAMS`].
    Program(&'static str),
    /// A script of the repository or another tool.
    Other,
}

/// Who `words` (a span or a command line, split at whitespace) belong to: `None` when
/// they do not begin with a command (they begin with a flag, or name no flag at all).
fn owner(words: &[&str]) -> Option<Owner> {
    let first = *words.first()?;
    if first.starts_with('-') {
        return None;
    }
    let base = first.rsplit('/').next().unwrap_or(first);
    if let Some(p) = PROGRAMS.iter().find(|p| **p == base) {
        let sub = words.get(1).map(|w| format!("{base} {w}"));
        let program = PROGRAMS
            .iter()
            .find(|p| Some(p.to_string()) == sub)
            .unwrap_or(p);
        return Some(Owner::Program(program));
    }
    let script = ["scripts/", "./scripts/", "deploy/", "./deploy/", ".ci/"]
        .iter()
        .any(|d| first.starts_with(d));
    let tool = words[1..].iter().any(|w| flag_name(w).is_some());
    (script || tool).then_some(Owner::Other)
}

/// The flags in `words`, with the punctuation a doc puts around them (`[--json FILE]`,
/// `(--flag)`) taken off.
fn flags_in<'a>(words: &[&'a str]) -> Vec<&'a str> {
    words
        .iter()
        .filter_map(|w| flag_name(w.trim_start_matches(['[', '(', '"', '\''])))
        .collect()
}

/// A flag a doc names, where.
#[derive(Debug)]
struct DocFlag {
    file: String,
    line: usize,
    flag: String,
    /// The program whose command names it, or `None` for a span that begins with it.
    program: Option<&'static str>,
}

/// The spans and command lines of a Markdown text, with their line numbers: inline
/// backticked spans, and the lines of fenced code blocks (joined where one ends in `\`,
/// comments cut).
fn spans(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    let mut pending: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            let code = match line.find(" #") {
                Some(at) => &line[..at],
                None if line.trim_start().starts_with('#') => "",
                None => line,
            };
            let (start, mut joined) = pending.take().unwrap_or((n, String::new()));
            joined.push(' ');
            match code.trim_end().strip_suffix('\\') {
                Some(head) => {
                    joined.push_str(head);
                    pending = Some((start, joined));
                }
                None => {
                    joined.push_str(code);
                    out.push((start, joined));
                }
            }
            continue;
        }
        let mut parts = line.split('`');
        parts.next();
        while let (Some(inside), Some(_)) = (parts.next(), parts.next()) {
            out.push((n, inside.to_string()));
        }
    }
    out
}

/// The documents whose flags are held to the programs'.
fn docs() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let path = e.unwrap().path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n != "log") {
                    walk(&path, out);
                }
            } else if path.extension().is_some_and(|x| x == "md") {
                out.push(path);
            }
        }
    }
    let root = testkit::workspace_root();
    let mut files = vec![root.join("README.md")];
    walk(&root.join("docs"), &mut files);
    files.sort();
    files
}

/// Every flag the docs name, with the program it is held to.
fn doc_flags() -> Vec<DocFlag> {
    let root = testkit::workspace_root();
    let mut found = Vec::new();
    for path in docs() {
        let text = std::fs::read_to_string(&path).unwrap();
        let file = path.strip_prefix(&root).unwrap().display().to_string();
        let mut last: Option<Owner> = None;
        for (line, span) in spans(&text) {
            let words: Vec<&str> = span.split_whitespace().collect();
            let own = owner(&words);
            if own.is_some() {
                last = own;
            }
            let program = match (own, last) {
                (Some(Owner::Program(p)), _) => Some(p),
                (Some(Owner::Other), _) => continue,
                (None, Some(Owner::Other)) => continue,
                (None, _) => None,
            };
            for flag in flags_in(&words) {
                found.push(DocFlag {
                    file: file.clone(),
                    line,
                    flag: flag.to_string(),
                    program,
                });
            }
        }
    }
    found
}

#[test]
fn every_flag_the_docs_name_is_in_its_programs_help() {
    let programs = programs();
    let has = |p: &str, flag: &str| {
        CLAP_OWN.contains(&flag) || programs[p].iter().any(|f| f.name == flag)
    };
    let found = doc_flags();
    assert!(
        found.iter().any(|d| d.program == Some("driver capacity")) && found.len() > 100,
        "the docs' flags were not found: {found:?}"
    );
    let missing: Vec<String> = found
        .iter()
        .filter(|d| match d.program {
            Some(p) => !has(p, &d.flag),
            None => !PROGRAMS.iter().any(|p| has(p, &d.flag)),
        })
        .map(|d| {
            let whose = d.program.unwrap_or("any program");
            format!(
                "{}:{}: {} is not in {whose}'s --help",
                d.file, d.line, d.flag
            )
        })
        .collect();
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

#[test]
fn every_flag_of_every_program_has_its_environment_fallback() {
    let mut problems = Vec::new();
    for (program, flags) in programs() {
        assert!(flags.len() > 1, "{program}: no flags read from its --help");
        let mut envs: BTreeMap<String, String> = BTreeMap::new();
        for f in flags
            .iter()
            .filter(|f| !CLAP_OWN.contains(&f.name.as_str()))
        {
            let env = f
                .text
                .split("[env: ")
                .nth(1)
                .and_then(|rest| rest.split(['=', ']']).next());
            match env {
                Some(name) if name.starts_with("RPCMESH_") => {
                    if let Some(other) = envs.insert(name.to_string(), f.name.clone()) {
                        problems.push(format!("{program}: {} and {other} share {name}", f.name));
                    }
                }
                _ => problems.push(format!("{program}: {} has no RPCMESH_ fallback", f.name)),
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_walk_tells_a_programs_flags_from_a_scripts() {
    let words = |s: &'static str| s.split_whitespace().collect::<Vec<_>>();
    assert_eq!(
        owner(&words("driver capacity --target B:7700")),
        Some(Owner::Program("driver capacity"))
    );
    assert_eq!(
        owner(&words("target/release/broker --listen 0.0.0.0:7700")),
        Some(Owner::Program("broker"))
    );
    assert_eq!(owner(&words("scripts/bench")), Some(Owner::Other));
    assert_eq!(owner(&words("cargo test --test flags")), Some(Owner::Other));
    assert_eq!(owner(&words("--bin-dir DIR")), None);
    assert_eq!(owner(&words("rpcmesh_calls_total")), None);
    assert_eq!(flags_in(&words("merge d.hlog [--json f.json]")), ["--json"]);
    let md = "a `driver --rate 5` b `--x`\n```sh\ndriver capacity \\\n  --slo x  # --not\n```\n";
    let s = spans(md);
    assert_eq!(s[0], (1, "driver --rate 5".to_string()));
    assert_eq!(s[1], (1, "--x".to_string()));
    assert_eq!(s[2].0, 3);
    assert!(s[2].1.contains("capacity") && s[2].1.contains("--slo"));
    assert!(!s[2].1.contains("--not"));
    let help = "Options:\n      --target <T>\n          Text --not-a-flag\n          [env: RPCMESH_TARGETS=]\n  -h, --help\n";
    let f = flags_of(help);
    let names: BTreeSet<&str> = f.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, BTreeSet::from(["--target", "--help"]));
    assert!(f[0].text.contains("RPCMESH_TARGETS"));
}

/// The driver run as a user runs it, with `env` added to its environment.
fn driver<A: AsRef<std::ffi::OsStr>>(args: &[A], env: &[(&str, &str)]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_driver"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rpcmesh_targets_takes_several_targets_separated_by_commas() {
    let p = InProcess::start(|listener, telemetry, stop| {
        rpcmesh_provider::run_with(
            rpcmesh_provider::ProviderConfig::default(),
            rpcmesh_provider::Registry::builtin(),
            telemetry,
            listener,
            stop,
        )
    })
    .await;
    let dir = std::env::temp_dir().join(format!("rpcmesh-flags-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("report.json");
    let targets = format!("{0},{0}", p.addr);
    let run: Vec<String> = [
        "--requests",
        "20",
        "--concurrency",
        "4",
        "--warmup",
        "0s",
        "--metrics-listen",
        "off",
        "--progress",
        "off",
        "--json",
        json.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec();
    let out = tokio::task::spawn_blocking(move || driver(&run, &[("RPCMESH_TARGETS", &targets)]))
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r.setup.targets.len(), 2, "{:?}", r.setup.targets);
    assert!(r.calls.ok > 0);

    // Two targets run together with a space are refused before anything is dialled.
    let out = tokio::task::spawn_blocking(|| {
        driver(
            &["--requests", "1"],
            &[("RPCMESH_TARGETS", "127.0.0.1:1 127.0.0.1:2")],
        )
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "refused: {stderr}");
    assert!(stderr.contains("separated by commas"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
    p.stop().await;
}
