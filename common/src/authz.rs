//! Authorization: which identities may call which services and methods, read from a TOML
//! policy file (`--authz-policy`), and which peers may forward a caller's identity.
//!
//! ```toml
//! # Brokers whose calls carry their callers' identities (only a TLS peer with a verified
//! # certificate can be one).
//! forwarders = ["spiffe://example.org/broker/*"]
//!
//! [[allow]]
//! callers = ["spiffe://example.org/driver/*"]
//! calls = ["EchoService.*", "PlatformService.Query"]
//! ```
//!
//! The rules: once a policy is set, a call is allowed only when one `[[allow]]` names both
//! its caller and its `Service.Method`; everything else is denied. A pattern is a whole
//! name, or a prefix ending in `*` (`*` alone: anything). A caller without a certificate
//! (a plaintext connection, or TLS with client auth `optional`) is [`ANONYMOUS`], which
//! only a rule naming `anonymous` (or `*`) lets in. Heartbeats are never authorized: they
//! carry no call.
//!
//! A file that does not parse is refused whole, with its line ([`PolicyError`]); a
//! reload that fails keeps the policy in force ([`Authz::reload`]). What a program does
//! with a denial (the answer, the count, the log) is its session's.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use serde::Deserialize;
use toml::Spanned;

/// How a caller without an identity is named in policies and answers.
pub const ANONYMOUS: &str = "anonymous";
/// The largest policy file read: 1 MiB is thousands of rules; a larger file is a mistake.
pub const MAX_POLICY_BYTES: u64 = 1 << 20;

/// Why a policy could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("policy{}{}: {message}", .path.as_ref().map_or(String::new(), |p| format!(" {}", p.display())), .line.map_or(String::new(), |l| format!(" line {l}")))]
pub struct PolicyError {
    /// The file, when read from one.
    pub path: Option<PathBuf>,
    /// The line the problem is on, when it has one.
    pub line: Option<usize>,
    /// What is wrong.
    pub message: String,
}

/// A name or a prefix of names (also what `crate::retry::Idempotent` marks calls with).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Pattern {
    Any,
    Exact(String),
    Prefix(String),
}

impl Pattern {
    pub(crate) fn new(s: &str) -> Pattern {
        match s.strip_suffix('*') {
            Some("") => Pattern::Any,
            Some(prefix) => Pattern::Prefix(prefix.to_string()),
            None => Pattern::Exact(s.to_string()),
        }
    }

    fn matches(&self, name: &str) -> bool {
        match self {
            Pattern::Any => true,
            Pattern::Exact(n) => n == name,
            Pattern::Prefix(p) => name.starts_with(p.as_str()),
        }
    }

    /// [`Pattern::matches`] of `service.method`, without making that string.
    pub(crate) fn matches_call(&self, service: &str, method: &str) -> bool {
        // What is left of a pattern once `service` and the dot are taken off it.
        fn after<'a>(p: &'a str, service: &str) -> Option<&'a str> {
            p.strip_prefix(service)?.strip_prefix('.')
        }
        match self {
            Pattern::Any => true,
            Pattern::Exact(n) => after(n, service) == Some(method),
            Pattern::Prefix(p) if p.len() <= service.len() => service.starts_with(p.as_str()),
            Pattern::Prefix(p) => after(p, service).is_some_and(|m| method.starts_with(m)),
        }
    }
}

/// What is wrong with `name` as a pattern of calls (`Service.Method`, `Service.*` or
/// `*`), if anything.
pub(crate) fn call_pattern_problem(name: &str) -> Option<String> {
    let well_formed = name == "*"
        || name
            .split_once('.')
            .is_some_and(|(s, m)| !s.is_empty() && !m.is_empty());
    (!well_formed).then(|| format!("{name:?} is not Service.Method, Service.*, or *"))
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Rule {
    callers: Vec<Pattern>,
    calls: Vec<Pattern>,
}

/// A parsed policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    forwarders: Vec<Pattern>,
    rules: Vec<Rule>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileForm {
    #[serde(default)]
    forwarders: Vec<Spanned<String>>,
    #[serde(default)]
    allow: Vec<RuleForm>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleForm {
    callers: Vec<Spanned<String>>,
    calls: Vec<Spanned<String>>,
}

/// The line of byte `at` in `text`, counting from 1.
fn line_of(text: &str, at: usize) -> usize {
    text.as_bytes()[..at.min(text.len())]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

impl Policy {
    /// Parses a policy's text.
    pub fn parse(text: &str) -> Result<Policy, PolicyError> {
        let form: FileForm = toml::from_str(text).map_err(|e| PolicyError {
            path: None,
            line: e.span().map(|s| line_of(text, s.start)),
            message: e.message().to_string(),
        })?;
        let problem = |s: &Spanned<String>, message: String| PolicyError {
            path: None,
            line: Some(line_of(text, s.span().start)),
            message,
        };
        let mut rules = Vec::new();
        for r in &form.allow {
            for c in &r.calls {
                if let Some(m) = call_pattern_problem(c.get_ref()) {
                    return Err(problem(c, m));
                }
            }
            for c in &r.callers {
                if c.get_ref().is_empty() {
                    return Err(problem(c, "an empty caller".into()));
                }
            }
            rules.push(Rule {
                callers: r
                    .callers
                    .iter()
                    .map(|c| Pattern::new(c.get_ref()))
                    .collect(),
                calls: r.calls.iter().map(|c| Pattern::new(c.get_ref())).collect(),
            });
        }
        Ok(Policy {
            forwarders: form
                .forwarders
                .iter()
                .map(|f| Pattern::new(f.get_ref()))
                .collect(),
            rules,
        })
    }

    /// Reads and parses a policy file (bounded by [`MAX_POLICY_BYTES`]).
    pub fn read(path: &Path) -> Result<Policy, PolicyError> {
        use std::io::Read;
        let fail = |message: String| PolicyError {
            path: Some(path.to_path_buf()),
            line: None,
            message,
        };
        let f = crate::files::open_regular(path).map_err(|e| fail(e.to_string()))?;
        let mut bytes = Vec::new();
        f.take(MAX_POLICY_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| fail(e.to_string()))?;
        if bytes.len() as u64 > MAX_POLICY_BYTES {
            return Err(fail(format!("over {MAX_POLICY_BYTES} bytes")));
        }
        let text = String::from_utf8(bytes).map_err(|_| fail("not UTF-8".into()))?;
        Policy::parse(&text).map_err(|e| PolicyError {
            path: Some(path.to_path_buf()),
            ..e
        })
    }

    /// Whether `caller` (`None`: anonymous) may call `service`.`method`.
    pub fn allows(&self, caller: Option<&str>, service: &str, method: &str) -> bool {
        let caller = caller.unwrap_or(ANONYMOUS);
        self.rules.iter().any(|r| {
            r.callers.iter().any(|c| c.matches(caller))
                && r.calls.iter().any(|c| c.matches_call(service, method))
        })
    }

    /// Whether a peer of identity `peer` may forward its callers' identities. An
    /// anonymous peer never may: only a verified certificate makes a forwarder.
    pub fn may_forward(&self, peer: Option<&str>) -> bool {
        peer.is_some_and(|p| self.forwarders.iter().any(|f| f.matches(p)))
    }
}

/// The answer to a denied call: `permission denied: IDENTITY may not call Service.Method`
/// (the status's name starts it, as for every extended status).
pub fn denial(caller: Option<&str>, service: &str, method: &str) -> String {
    format!(
        "permission denied: {} may not call {service}.{method}",
        caller.unwrap_or(ANONYMOUS)
    )
}

/// A program's policy: the one in force, replaced whole by a reload that succeeds.
#[derive(Debug)]
pub struct Authz {
    path: PathBuf,
    policy: ArcSwap<Policy>,
}

impl Authz {
    /// Reads the policy at `path`.
    pub fn load(path: &Path) -> Result<Arc<Authz>, PolicyError> {
        Ok(Arc::new(Authz {
            path: path.to_path_buf(),
            policy: ArcSwap::from_pointee(Policy::read(path)?),
        }))
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the file again: in force at once when it parses, else the policy stays.
    pub fn reload(&self) -> Result<(), PolicyError> {
        self.policy.store(Arc::new(Policy::read(&self.path)?));
        Ok(())
    }

    /// The policy in force (a lock-free read).
    pub fn policy(&self) -> arc_swap::Guard<Arc<Policy>> {
        self.policy.load()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: &str = r#"
forwarders = ["spiffe://t/broker/*"]

[[allow]]
callers = ["spiffe://t/driver/*"]
calls = ["EchoService.*", "PlatformService.Query"]

[[allow]]
callers = ["anonymous", "ops.example"]
calls = ["PlatformService.Health"]
"#;

    #[test]
    fn a_call_is_allowed_only_when_a_rule_names_its_caller_and_its_method() {
        let p = Policy::parse(POLICY).unwrap();
        let d = Some("spiffe://t/driver/d1");
        assert!(p.allows(d, "EchoService", "Echo"));
        assert!(p.allows(d, "PlatformService", "Query"));
        assert!(!p.allows(d, "PlatformService", "Drop"));
        assert!(
            !p.allows(d, "Echo", "Service"),
            "a prefix of the service alone"
        );
        assert!(!p.allows(Some("spiffe://t/drivers/x"), "EchoService", "Echo"));
        assert!(!p.allows(None, "EchoService", "Echo"));
        assert!(p.allows(None, "PlatformService", "Health"));
        assert!(p.allows(Some("ops.example"), "PlatformService", "Health"));
        assert!(!Policy::parse("").unwrap().allows(d, "EchoService", "Echo"));
    }

    #[test]
    fn only_a_named_peer_may_forward_identities_and_never_an_anonymous_one() {
        let p = Policy::parse(POLICY).unwrap();
        assert!(p.may_forward(Some("spiffe://t/broker/b1")));
        assert!(!p.may_forward(Some("spiffe://t/driver/d1")));
        assert!(!p.may_forward(None));
        let any = Policy::parse("forwarders = [\"*\"]").unwrap();
        assert!(!any.may_forward(None), "even with * for everyone");
    }

    #[test]
    fn a_bad_policy_names_its_line() {
        let cases = [
            ("[[allow]]\ncallers = [\"a\"]\ncalls = [\"Echo\"]\n", 3),
            ("[[allow]]\ncallers = [\"a\"]\n\ncals = [\"E.M\"]\n", 4),
            ("forwarders = [\n", 1),
        ];
        for (text, line) in cases {
            let e = Policy::parse(text).unwrap_err();
            assert_eq!(e.line, Some(line), "{text:?}: {e}");
        }
        assert_eq!(
            denial(None, "EchoService", "Echo"),
            "permission denied: anonymous may not call EchoService.Echo"
        );
    }
}
