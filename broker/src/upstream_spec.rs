//! One configured provider ([`UpstreamSpec`]): its address, the services it serves, and
//! the kind of peer it is; and the `--upstream` syntax, `HOST:PORT` (any service) or
//! `SERVICE[,SERVICE]=HOST:PORT`. The flags (`config`) and the providers file
//! (`providers_file`) both give providers in it.

use rpcmesh_wire::PeerKind;

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

impl UpstreamSpec {
    /// Parses `HOST:PORT` or `Service1,Service2=HOST:PORT`.
    pub fn parse(s: &str, kind: PeerKind) -> Result<UpstreamSpec, String> {
        let (services, addr) = match s.split_once('=') {
            Some((svc, addr)) => (
                svc.split(',')
                    .map(str::trim)
                    .filter(|x| !x.is_empty())
                    .map(String::from)
                    .collect::<Vec<_>>(),
                addr.trim(),
            ),
            None => (Vec::new(), s.trim()),
        };
        let ok = addr
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
        if !ok {
            return Err(format!(
                "upstream {s:?}: expected HOST:PORT or SERVICE[,SERVICE]=HOST:PORT"
            ));
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_specs_parse() {
        let u = UpstreamSpec::parse("127.0.0.1:7800", PeerKind::Rpcmesh).unwrap();
        assert!(u.services.is_empty());
        let u = UpstreamSpec::parse("EchoService, PlatformService=p1.example:7800", PeerKind::V1)
            .unwrap();
        assert_eq!(u.services, ["EchoService", "PlatformService"]);
        assert_eq!(u.addr, "p1.example:7800");
        assert_eq!(u.kind, PeerKind::V1);
        assert!(UpstreamSpec::parse("nohost", PeerKind::Rpcmesh).is_err());
        assert!(UpstreamSpec::parse("h:notaport", PeerKind::Rpcmesh).is_err());
    }
}
