//! One configured provider ([`UpstreamSpec`]): its address, the services it serves, and
//! the kind of peer it is; and the `--upstream` syntax, `HOST:PORT` (any service) or
//! `SERVICE[,SERVICE]=HOST:PORT`, checked whole ([`SpecError`] says what is wrong). The
//! flags (`config`) and the providers file (`providers_file`) both give providers in it.
//!
//! A service name is what a protobuf service is called, with its package if it has one:
//! parts of letters, digits and `_`, each starting with a letter or `_`, joined by `.`
//! (`EchoService`, `platform.PlatformService`). The wire takes any UTF-8 name, but a
//! name outside that form in a spec is a typo (`EchoService;PlatformService`), and served
//! as written it would route nothing: every call would be answered "service not found".

use std::fmt;

use rpcmesh_wire::PeerKind;

/// The forms a spec takes, as the errors give them.
pub const FORM: &str = "HOST:PORT (any service) or SERVICE[,SERVICE]=HOST:PORT";

/// One configured provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamSpec {
    /// `HOST:PORT`, resolved at each connect.
    pub addr: String,
    /// Services it serves; empty = any service.
    pub services: Vec<String>,
    /// An rpcmesh provider (it takes the extension flags) or a plain RPCF v1 server, to
    /// which only plain v1 frames are sent.
    pub kind: PeerKind,
}

/// What is wrong with a spec.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecProblem {
    /// Nothing at all, or nothing after `=`.
    #[error("no address")]
    NoAddress,
    /// The address has no `:PORT`.
    #[error("{0:?} has no port: write HOST:PORT")]
    NoPort(String),
    /// A service list cut at a blank after a comma (`--upstream 'A, B=h:1'`: blanks
    /// separate providers in the flags and their environment variables).
    #[error(
        "{0:?} ends with \",\": write the services without a blank after the commas (a blank separates providers)"
    )]
    CutAtBlank(String),
    /// The port is not 1-65535.
    #[error("port {0:?} is not a number from 1 to 65535")]
    BadPort(String),
    /// The host is not a host name, an IPv4 address or a bracketed IPv6 one.
    #[error("host {0:?} is not a host name or an IP address (an IPv6 one in brackets)")]
    BadHost(String),
    /// `=` with nothing before it.
    #[error("no service before \"=\"")]
    NoService,
    /// Two commas in a row, or one at either end of the list.
    #[error("an empty service name in {0:?} (services are separated by one \",\")")]
    EmptyService(String),
    /// A character no service name has.
    #[error("service name {name:?} has {bad:?}, which a service name cannot have{hint}")]
    BadServiceChar {
        /// The name.
        name: String,
        /// The first character that cannot be there.
        bad: char,
        /// What was likely meant.
        hint: &'static str,
    },
    /// A part of the name that starts with a digit, or is empty (`a..b`, `.a`).
    #[error(
        "service name {0:?} is not a protobuf service name: parts of letters, digits and _, each starting with a letter or _, joined by \".\""
    )]
    BadServiceName(String),
    /// The same service twice in one spec.
    #[error("service {0} is listed twice")]
    Duplicate(String),
}

/// Why a spec was refused: the spec as given, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecError {
    /// The spec as given.
    pub spec: String,
    /// What is wrong.
    pub problem: SpecProblem,
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}; the form is {FORM}", self.spec, self.problem)
    }
}

impl std::error::Error for SpecError {}

impl UpstreamSpec {
    /// Parses `HOST:PORT` or `Service1,Service2=HOST:PORT` (blanks around the parts are
    /// left out).
    pub fn parse(s: &str, kind: PeerKind) -> Result<UpstreamSpec, SpecError> {
        let fail = |problem| SpecError {
            spec: s.to_string(),
            problem,
        };
        let (services, addr) = match s.split_once('=') {
            Some((list, addr)) => (services(list).map_err(fail)?, addr.trim()),
            None => (Vec::new(), s.trim()),
        };
        check_addr(addr).map_err(fail)?;
        Ok(UpstreamSpec {
            addr: addr.to_string(),
            services,
            kind,
        })
    }

    /// The label used in metrics and logs: the address as configured.
    pub fn label(&self) -> &str {
        &self.addr
    }

    /// Its services as a log line gives them: `any service`, or the names as a spec
    /// lists them (`EchoService,PlatformService`).
    pub fn services_text(&self) -> String {
        if self.services.is_empty() {
            "any service".to_string()
        } else {
            self.services.join(",")
        }
    }
}

/// The spec as it is written: `v1 ` first for a plain v1 server (as in the providers
/// file), then `SERVICE[,SERVICE]=` if it serves only those, then `HOST:PORT`.
impl fmt::Display for UpstreamSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.kind == PeerKind::V1 {
            write!(f, "{} ", crate::providers_file::V1_MARK)?;
        }
        if !self.services.is_empty() {
            write!(f, "{}=", self.services.join(","))?;
        }
        f.write_str(&self.addr)
    }
}

/// The services of `SERVICE[,SERVICE]`, each checked.
fn services(list: &str) -> Result<Vec<String>, SpecProblem> {
    if list.trim().is_empty() {
        return Err(SpecProblem::NoService);
    }
    let mut out: Vec<String> = Vec::new();
    for name in list.split(',').map(str::trim) {
        if name.is_empty() {
            return Err(SpecProblem::EmptyService(list.trim().to_string()));
        }
        check_service_name(name)?;
        if out.iter().any(|s| s == name) {
            return Err(SpecProblem::Duplicate(name.to_string()));
        }
        out.push(name.to_string());
    }
    Ok(out)
}

/// Checks that `name` is a protobuf service name, with its package if any (see the
/// module's doc).
pub fn check_service_name(name: &str) -> Result<(), SpecProblem> {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    if let Some(bad) = name.chars().find(|&c| !word(c) && c != '.') {
        let hint = match bad {
            ';' | ' ' | '\t' | '|' | '/' | '+' | '&' => ": separate services with \",\"",
            ':' => ": services come first, then \"=\" and HOST:PORT",
            _ => "",
        };
        return Err(SpecProblem::BadServiceChar {
            name: name.to_string(),
            bad,
            hint,
        });
    }
    let part_ok = |p: &str| {
        p.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
    };
    if !name.split('.').all(part_ok) {
        return Err(SpecProblem::BadServiceName(name.to_string()));
    }
    Ok(())
}

/// Checks `HOST:PORT`: a host name (letters, digits, `-`, `_`, `.`), an IPv4 address or
/// an IPv6 one in brackets, and a port from 1 to 65535.
fn check_addr(addr: &str) -> Result<(), SpecProblem> {
    if addr.is_empty() {
        return Err(SpecProblem::NoAddress);
    }
    if addr.ends_with(',') {
        return Err(SpecProblem::CutAtBlank(addr.to_string()));
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(SpecProblem::NoPort(addr.to_string()));
    };
    if port.parse::<u16>().map_or(true, |p| p == 0) {
        return Err(SpecProblem::BadPort(port.to_string()));
    }
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => {
            !host.is_empty()
                && host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        }
    };
    if !host_ok {
        return Err(SpecProblem::BadHost(host.to_string()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(s: &str) -> SpecProblem {
        UpstreamSpec::parse(s, PeerKind::Rpcmesh)
            .expect_err(s)
            .problem
    }

    #[test]
    fn upstream_specs_parse() {
        let u = UpstreamSpec::parse("127.0.0.1:7800", PeerKind::Rpcmesh).unwrap();
        assert!(u.services.is_empty());
        let u = UpstreamSpec::parse("EchoService, PlatformService=p1.example:7800", PeerKind::V1)
            .unwrap();
        assert_eq!(u.services, ["EchoService", "PlatformService"]);
        assert_eq!(u.addr, "p1.example:7800");
        assert_eq!(u.kind, PeerKind::V1);
        let u =
            UpstreamSpec::parse("platform.PlatformService,_x.y2=[::1]:7800", PeerKind::V1).unwrap();
        assert_eq!(u.services, ["platform.PlatformService", "_x.y2"]);
        assert_eq!(u.addr, "[::1]:7800");
        assert!(UpstreamSpec::parse("my-host_1.example:1", PeerKind::V1).is_ok());
    }

    #[test]
    fn a_spec_that_cannot_be_meant_is_refused_saying_what_is_wrong() {
        assert_eq!(
            problem("EchoService;PlatformService=p1:7800"),
            SpecProblem::BadServiceChar {
                name: "EchoService;PlatformService".into(),
                bad: ';',
                hint: ": separate services with \",\"",
            }
        );
        assert!(matches!(
            problem("p1:7800=EchoService"),
            SpecProblem::BadServiceChar { bad: ':', .. }
        ));
        assert_eq!(problem("=p1:7800"), SpecProblem::NoService);
        assert_eq!(
            problem("EchoService,,PlatformService=p1:7800"),
            SpecProblem::EmptyService("EchoService,,PlatformService".into())
        );
        assert!(matches!(
            problem("EchoService,=p1:7800"),
            SpecProblem::EmptyService(_)
        ));
        assert_eq!(
            problem("EchoService,EchoService=p1:7800"),
            SpecProblem::Duplicate("EchoService".into())
        );
        for bad in ["1Echo=p:1", "a..b=p:1", ".a=p:1", "a.=p:1"] {
            assert!(
                matches!(problem(bad), SpecProblem::BadServiceName(_)),
                "{bad}"
            );
        }
        assert_eq!(problem("nohost"), SpecProblem::NoPort("nohost".into()));
        assert_eq!(
            problem("EchoService,"),
            SpecProblem::CutAtBlank("EchoService,".into())
        );
        assert_eq!(
            problem("h:notaport"),
            SpecProblem::BadPort("notaport".into())
        );
        assert_eq!(problem("h:0"), SpecProblem::BadPort("0".into()));
        assert_eq!(problem("h:70000"), SpecProblem::BadPort("70000".into()));
        assert_eq!(problem(":7800"), SpecProblem::BadHost(String::new()));
        assert_eq!(problem("A=B=h:1"), SpecProblem::BadHost("B=h".into()));
        assert_eq!(problem("[zz]:1"), SpecProblem::BadHost("[zz]".into()));
        assert_eq!(problem("Echo="), SpecProblem::NoAddress);
        assert_eq!(problem(""), SpecProblem::NoAddress);
    }

    #[test]
    fn a_spec_reads_back_as_written_and_its_services_as_a_log_gives_them() {
        for s in ["a:1", "EchoService,PlatformService=a:1"] {
            let u = UpstreamSpec::parse(s, PeerKind::Rpcmesh).unwrap();
            assert_eq!(u.to_string(), s);
        }
        let v1 = UpstreamSpec::parse("Legacy=a:1", PeerKind::V1).unwrap();
        assert_eq!(v1.to_string(), "v1 Legacy=a:1");
        assert_eq!(v1.services_text(), "Legacy");
        let any = UpstreamSpec::parse("a:1", PeerKind::V1).unwrap();
        assert_eq!(any.services_text(), "any service");
    }

    #[test]
    fn the_error_names_the_spec_the_problem_and_the_form() {
        let e = UpstreamSpec::parse("EchoService;PlatformService=p1:7800", PeerKind::Rpcmesh)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "\"EchoService;PlatformService=p1:7800\": service name \"EchoService;PlatformService\" has ';', which a service name cannot have: separate services with \",\"; the form is HOST:PORT (any service) or SERVICE[,SERVICE]=HOST:PORT"
        );
    }
}
