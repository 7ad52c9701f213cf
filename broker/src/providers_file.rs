//! The providers file (`--providers-file`): its format, reading it, and telling whether it
//! changed. Which providers are served, and what changes when the file does, is
//! `membership`'s.
//!
//! One provider per line, in the `--upstream` syntax; `v1 ` before it marks a plain RPCF
//! v1 server (what `--upstream-v1` gives); a line `idempotent CALLS…` marks calls that may
//! run twice (as `--idempotent` does: `Service.Method`, `Service.*` or `*`, separated by
//! blanks or commas; docs/resilience.md); `#` starts a comment, to the end of the line;
//! blank lines are skipped:
//!
//! ```text
//! # rpcmesh providers of this broker
//! 10.0.0.3:7800                            # any service
//! EchoService,PlatformService=10.0.0.4:7800
//! v1 LegacyService=10.0.0.9:7000           # a plain v1 server
//! idempotent EchoService.* PlatformService.doQuery
//! ```
//!
//! An address may appear once, in the file and the flags together (it names the
//! provider's metrics and its pool). A file that cannot be read or has a bad line is
//! refused whole, with every bad line listed ([`ProvidersFileError`]). So is a file that
//! lists no provider, unless the broker is told it may (`--allow-empty-providers`): a file
//! left empty or cut short by a failed write would otherwise take every provider it listed
//! out of service, and every call would be answered "service not found".

use std::collections::HashMap;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use rpcmesh_common::retry::Idempotent;
use rpcmesh_wire::PeerKind;

use crate::upstream_spec::{FORM, SpecProblem, UpstreamSpec};

/// Largest providers file read: a file lists tens or hundreds of providers (a few KiB);
/// 1 MiB is far beyond that and bounds what a wrong path (a log file) costs.
pub const MAX_FILE_BYTES: u64 = 1 << 20;
/// Most providers a broker serves, flags and file together: each costs a pool of
/// connections and a keeper task; 1,024 is far above any deployment's count and bounds
/// what a runaway file costs (4,096 connections at the default pool size).
pub const MAX_PROVIDERS: usize = 1024;
/// The word that marks a plain RPCF v1 server, before its address.
pub const V1_MARK: &str = "v1";
/// The word that begins a line of calls marked idempotent.
pub const IDEMPOTENT_MARK: &str = "idempotent";
/// Bad lines named in a [`ProvidersFileError::Invalid`]'s message; the others are counted.
const PROBLEMS_SHOWN: usize = 10;

/// What is wrong with one line of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineProblem {
    /// 1-based line number (0: the file as a whole).
    pub line: usize,
    /// What is wrong.
    pub problem: String,
}

impl fmt::Display for LineProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            f.write_str(&self.problem)
        } else {
            write!(f, "line {}: {}", self.line, self.problem)
        }
    }
}

/// Why a providers file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ProvidersFileError {
    /// It could not be read (missing, not permitted, not text).
    #[error("providers file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// It is larger than [`MAX_FILE_BYTES`].
    #[error("providers file {}: over {} bytes, too large for a providers file", path.display(), MAX_FILE_BYTES)]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// Some of its lines are wrong.
    #[error("providers file {}: {}", path.display(), list(problems))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Every bad line, in order.
        problems: Vec<LineProblem>,
    },
    /// It lists no provider, and the broker may not serve none from it.
    #[error("providers file {}: lists no provider, refused (an empty or cut-short file would take every provider it listed out of service); give --allow-empty-providers if it may list none", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
}

fn list(problems: &[LineProblem]) -> String {
    let mut text: Vec<String> = problems
        .iter()
        .take(PROBLEMS_SHOWN)
        .map(ToString::to_string)
        .collect();
    if problems.len() > PROBLEMS_SHOWN {
        text.push(format!("and {} more", problems.len() - PROBLEMS_SHOWN));
    }
    text.join("; ")
}

/// Parses the file's text into providers, after those of the flags (`flags`, already
/// valid), in file order; every bad line is listed.
pub fn parse(text: &str, flags: &[UpstreamSpec]) -> Result<Vec<UpstreamSpec>, Vec<LineProblem>> {
    let mut problems = Vec::new();
    let mut seen: HashMap<String, usize> = flags.iter().map(|u| (u.addr.clone(), 0)).collect();
    let mut providers = flags.to_vec();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let content = raw.split_once('#').map_or(raw, |(before, _)| before).trim();
        if content.is_empty() {
            continue;
        }
        let (kind, rest) = match content.split_once(char::is_whitespace) {
            Some((mark, rest)) if mark == V1_MARK => (PeerKind::V1, rest.trim()),
            Some((mark, rest)) if mark == IDEMPOTENT_MARK => {
                if let Err(problem) = idempotent_calls(rest) {
                    problems.push(LineProblem { line, problem });
                }
                continue;
            }
            _ => (PeerKind::Rpcmesh, content),
        };
        let spec = match parse_spec(rest, kind) {
            Ok(s) => s,
            Err(problem) => {
                problems.push(LineProblem { line, problem });
                continue;
            }
        };
        match seen.get(&spec.addr) {
            Some(0) => problems.push(LineProblem {
                line,
                problem: format!("provider {} is given by a flag already", spec.addr),
            }),
            Some(first) => problems.push(LineProblem {
                line,
                problem: format!("provider {} is listed on line {first} already", spec.addr),
            }),
            None => {
                seen.insert(spec.addr.clone(), line);
                providers.push(spec);
            }
        }
    }
    if providers.len() > MAX_PROVIDERS {
        problems.push(LineProblem {
            line: 0,
            problem: format!(
                "{} providers, more than the {MAX_PROVIDERS} a broker serves",
                providers.len()
            ),
        });
    }
    if problems.is_empty() {
        Ok(providers)
    } else {
        Err(problems)
    }
}

/// The calls of an `idempotent` line (after the mark), or what is wrong with them.
fn idempotent_calls(rest: &str) -> Result<Idempotent, String> {
    let calls: Vec<&str> = rest
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|c| !c.is_empty())
        .collect();
    if calls.is_empty() {
        return Err(format!(
            "{IDEMPOTENT_MARK:?} with no call after it: name them as Service.Method, Service.* or *"
        ));
    }
    Idempotent::parse(&calls).map_err(|e| format!("{IDEMPOTENT_MARK}: {e}"))
}

/// The calls the file's `idempotent` lines mark (every line valid: [`parse`] checked them;
/// one that is not marks nothing).
pub fn idempotent(text: &str) -> Idempotent {
    let mut marked = Idempotent::default();
    for raw in text.lines() {
        let content = raw.split_once('#').map_or(raw, |(before, _)| before).trim();
        if let Some((IDEMPOTENT_MARK, rest)) = content.split_once(char::is_whitespace) {
            if let Ok(calls) = idempotent_calls(rest) {
                marked = marked.and(&calls);
            }
        }
    }
    marked
}

/// One provider, in the `--upstream` syntax; the problem is named, with the line's forms.
fn parse_spec(s: &str, kind: PeerKind) -> Result<UpstreamSpec, String> {
    UpstreamSpec::parse(s, kind).map_err(|e| {
        let problem = match &e.problem {
            SpecProblem::BadHost(h) if h.contains(char::is_whitespace) => {
                format!("{h:?} has a blank: only {V1_MARK:?} may come before a provider")
            }
            p => p.to_string(),
        };
        format!(
            "{s:?}: {problem}; the form is {FORM}, with {V1_MARK:?} before it for a plain v1 server"
        )
    })
}

/// Reads the file at `path` (at most [`MAX_FILE_BYTES`]).
pub fn read_text(path: &Path) -> Result<String, ProvidersFileError> {
    let read_err = |source| ProvidersFileError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = rpcmesh_common::files::open_regular(path).map_err(read_err)?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_err)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(ProvidersFileError::TooLarge {
            path: path.to_path_buf(),
        });
    }
    String::from_utf8(bytes).map_err(|_| {
        read_err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not UTF-8 text",
        ))
    })
}

/// Whether a providers file may list no provider (`--allow-empty-providers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IfEmpty {
    /// A file that lists none is refused ([`ProvidersFileError::Empty`]).
    Refuse,
    /// A file that lists none takes the providers it listed out of service.
    Allow,
}

impl IfEmpty {
    /// As `--allow-empty-providers` says.
    pub fn allowed(allow: bool) -> IfEmpty {
        if allow {
            IfEmpty::Allow
        } else {
            IfEmpty::Refuse
        }
    }
}

/// The providers of the flags (`flags`) and of the file at `path`, or why the file is
/// refused.
pub fn read(
    path: &Path,
    flags: &[UpstreamSpec],
    if_empty: IfEmpty,
) -> Result<Vec<UpstreamSpec>, ProvidersFileError> {
    let text = read_text(path)?;
    providers_of(path, &text, flags, if_empty)
}

/// As [`read`], from text already read.
pub fn providers_of(
    path: &Path,
    text: &str,
    flags: &[UpstreamSpec],
    if_empty: IfEmpty,
) -> Result<Vec<UpstreamSpec>, ProvidersFileError> {
    let providers = parse(text, flags).map_err(|problems| ProvidersFileError::Invalid {
        path: path.to_path_buf(),
        problems,
    })?;
    if providers.len() == flags.len() && if_empty == IfEmpty::Refuse {
        return Err(ProvidersFileError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(providers)
}

/// What tells a file's versions apart without reading it: which file the path names
/// (device and inode, which change when an editor or Ansible replaces it by rename), its
/// size and its modification time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    modified: Option<SystemTime>,
}

impl FileStamp {
    /// The stamp of the file `path` names now; `None` when there is none (or it cannot be
    /// looked at), as between the two steps of a replacement.
    pub fn of(path: &Path) -> Option<FileStamp> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).ok()?;
        Some(FileStamp {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            modified: m.modified().ok(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use PeerKind::{Rpcmesh, V1};

    fn addrs(p: &[UpstreamSpec]) -> Vec<(&str, PeerKind, Vec<&str>)> {
        p.iter()
            .map(|u| {
                (
                    u.addr.as_str(),
                    u.kind,
                    u.services.iter().map(String::as_str).collect(),
                )
            })
            .collect()
    }

    #[test]
    fn lines_comments_blanks_and_v1_servers_parse() {
        let text = "# providers\n\n10.0.0.3:7800\n  EchoService, PlatformService=p4:7800   # two\nv1 old:7000\nv1\tLegacy=old2:7000\n";
        let p = parse(text, &[]).unwrap();
        assert_eq!(
            addrs(&p),
            [
                ("10.0.0.3:7800", Rpcmesh, vec![]),
                ("p4:7800", Rpcmesh, vec!["EchoService", "PlatformService"]),
                ("old:7000", V1, vec![]),
                ("old2:7000", V1, vec!["Legacy"]),
            ]
        );
    }

    #[test]
    fn idempotent_lines_mark_calls_and_list_no_provider() {
        let text = "a:1\nidempotent EchoService.*, PlatformService.doQuery # safe twice\nidempotent Other.get\n";
        assert_eq!(
            addrs(&parse(text, &[]).unwrap()),
            [("a:1", Rpcmesh, vec![])]
        );
        let marked = idempotent(text);
        assert!(marked.covers("EchoService", "Echo"));
        assert!(marked.covers("PlatformService", "doQuery"));
        assert!(marked.covers("Other", "get"));
        assert!(!marked.covers("PlatformService", "doUpdate"));
        assert!(idempotent("a:1\n").is_empty());
        let problems = parse("idempotent\nidempotent EchoService\n", &[]).unwrap_err();
        let lines: Vec<usize> = problems.iter().map(|p| p.line).collect();
        assert_eq!(lines, [1, 2], "{problems:?}");
        assert!(
            problems[1].problem.contains("not Service.Method"),
            "{problems:?}"
        );
    }

    #[test]
    fn a_file_of_comments_only_lists_no_provider() {
        assert_eq!(parse("# none yet\n\n   \n", &[]).unwrap(), []);
        assert_eq!(parse("", &[]).unwrap(), []);
    }

    #[test]
    fn a_file_that_lists_no_provider_is_refused_unless_allowed() {
        let flags = [UpstreamSpec::parse("a:1", Rpcmesh).unwrap()];
        for text in ["", "# cut short\n"] {
            let e = providers_of(Path::new("p"), text, &flags, IfEmpty::Refuse).unwrap_err();
            assert!(matches!(e, ProvidersFileError::Empty { .. }), "{e}");
            assert!(e.to_string().contains("--allow-empty-providers"), "{e}");
            let allowed = providers_of(Path::new("p"), text, &flags, IfEmpty::Allow).unwrap();
            assert_eq!(addrs(&allowed), [("a:1", Rpcmesh, vec![])]);
        }
        let one = providers_of(Path::new("p"), "b:2\n", &flags, IfEmpty::Refuse).unwrap();
        assert_eq!(one.len(), 2);
    }

    #[test]
    fn providers_of_the_flags_come_first() {
        let flags = [UpstreamSpec::parse("a:1", Rpcmesh).unwrap()];
        let p = parse("b:2\n", &flags).unwrap();
        assert_eq!(
            addrs(&p),
            [("a:1", Rpcmesh, vec![]), ("b:2", Rpcmesh, vec![])]
        );
    }

    #[test]
    fn every_bad_line_is_named_with_its_number() {
        let flags = [UpstreamSpec::parse("a:1", Rpcmesh).unwrap()];
        let text = "ok:1\nnohost\nv2 x:1\n\nok:1\na:1\nh:notaport\nhost with space:1\nEchoService;PlatformService=p:1\n";
        let problems = parse(text, &flags).unwrap_err();
        let lines: Vec<usize> = problems.iter().map(|p| p.line).collect();
        assert_eq!(lines, [2, 3, 5, 6, 7, 8, 9], "{problems:?}");
        assert!(
            problems[6].problem.starts_with(
                "\"EchoService;PlatformService=p:1\": service name \"EchoService;PlatformService\" has ';', which a service name cannot have: separate services with \",\"; the form is"
            ),
            "{}",
            problems[6].problem
        );
        assert_eq!(
            problems[0].problem,
            "\"nohost\": \"nohost\" has no port: write HOST:PORT; the form is HOST:PORT (any service) or SERVICE[,SERVICE]=HOST:PORT, with \"v1\" before it for a plain v1 server"
        );
        assert!(
            problems[1].problem.starts_with(
                "\"v2 x:1\": \"v2 x\" has a blank: only \"v1\" may come before a provider;"
            ),
            "{}",
            problems[1].problem
        );
        assert_eq!(
            problems[2].problem,
            "provider ok:1 is listed on line 1 already"
        );
        assert_eq!(
            problems[3].problem,
            "provider a:1 is given by a flag already"
        );
        let e = ProvidersFileError::Invalid {
            path: "/etc/rpcmesh/providers".into(),
            problems,
        };
        let msg = e.to_string();
        assert!(
            msg.starts_with(
                "providers file /etc/rpcmesh/providers: line 2: \"nohost\": \"nohost\" has no port"
            ),
            "{msg}"
        );
    }

    #[test]
    fn too_many_providers_are_refused() {
        let text: String = (0..=MAX_PROVIDERS).map(|i| format!("h{i}:1\n")).collect();
        let problems = parse(&text, &[]).unwrap_err();
        assert_eq!(problems.len(), 1);
        assert!(
            problems[0].problem.contains("more than the 1024"),
            "{problems:?}"
        );
    }

    #[test]
    fn long_lists_of_problems_are_cut() {
        let text = "x\n".repeat(25);
        let e = ProvidersFileError::Invalid {
            path: "p".into(),
            problems: parse(&text, &[]).unwrap_err(),
        };
        assert!(e.to_string().ends_with("line 10: \"x\": \"x\" has no port: write HOST:PORT; the form is HOST:PORT (any service) or SERVICE[,SERVICE]=HOST:PORT, with \"v1\" before it for a plain v1 server; and 15 more"), "{e}");
    }

    #[test]
    fn files_are_read_bounded_and_stamped() {
        let dir = std::env::temp_dir().join(format!("rpcmesh-pfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("providers");
        assert!(matches!(
            read(&path, &[], IfEmpty::Refuse),
            Err(ProvidersFileError::Read { .. })
        ));
        assert_eq!(FileStamp::of(&path), None);
        std::fs::write(&path, "a:1\n").unwrap();
        let first = FileStamp::of(&path).unwrap();
        assert_eq!(read(&path, &[], IfEmpty::Refuse).unwrap().len(), 1);
        // Replaced by rename, as Ansible and editors do: another inode.
        let tmp = dir.join("providers.tmp");
        std::fs::write(&tmp, "a:1\n").unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        assert_ne!(FileStamp::of(&path).unwrap(), first);
        std::fs::write(&path, vec![b'#'; MAX_FILE_BYTES as usize + 1]).unwrap();
        assert!(matches!(
            read(&path, &[], IfEmpty::Refuse),
            Err(ProvidersFileError::TooLarge { .. })
        ));
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        let e = read(&path, &[], IfEmpty::Refuse).unwrap_err();
        assert!(e.to_string().contains("not UTF-8"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
