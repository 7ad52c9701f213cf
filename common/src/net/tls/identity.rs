//! Who a peer is: the identity its certificate names, read once per connection when the
//! handshake is done.
//!
//! The rule: a certificate's first URI subject alternative name (a SPIFFE ID such as
//! `spiffe://TRUST-DOMAIN/ROLE/NAME` is what rpcmesh's own certificates carry), else its
//! first DNS name. The subject's common name is never read: it is free text that name
//! checks have ignored for years, and an identity must be a name the CA vouched for in the
//! form a verifier checks. A certificate with neither names nobody, and is refused at the
//! handshake ([`NoIdentity`]), so every verified peer has an identity.
//!
//! An identity is only as good as the verification before it: this module reads names
//! and trusts nothing; the handshake's verifiers (`crate::net::tls::config`) decide whom
//! to believe.

use std::fmt;
use std::sync::Arc;

use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

/// The longest identity kept: a SPIFFE ID is at most 2,048 bytes; longer names are
/// refused rather than carried on every forwarded call.
pub const MAX_IDENTITY_LEN: usize = 2048;

/// The name a peer's certificate gives it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Identity {
    /// A URI SAN, typically `spiffe://TRUST-DOMAIN/ROLE/NAME`.
    Uri(Arc<str>),
    /// A DNS SAN.
    Dns(Arc<str>),
}

impl Identity {
    /// The identity as policies and logs write it: the URI, or the DNS name.
    pub fn as_str(&self) -> &str {
        match self {
            Identity::Uri(s) | Identity::Dns(s) => s,
        }
    }

    /// The identity a certificate (DER) names, if any (see the module's doc).
    pub fn of_certificate(der: &[u8]) -> Option<Identity> {
        let (_, cert) = X509Certificate::from_der(der).ok()?;
        let san = cert.subject_alternative_name().ok()??;
        let names = &san.value.general_names;
        let fits = |s: &&str| !s.is_empty() && s.len() <= MAX_IDENTITY_LEN;
        let uri = names.iter().find_map(|n| match n {
            GeneralName::URI(u) => Some(*u).filter(fits),
            _ => None,
        });
        if let Some(u) = uri {
            return Some(Identity::Uri(Arc::from(u)));
        }
        names.iter().find_map(|n| match n {
            GeneralName::DNSName(d) => Some(*d).filter(fits).map(|d| Identity::Dns(Arc::from(d))),
            _ => None,
        })
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The end of a certificate's validity (DER), as seconds since the Unix epoch.
pub fn not_after(der: &[u8]) -> Option<i64> {
    let (_, cert) = X509Certificate::from_der(der).ok()?;
    Some(cert.validity().not_after.timestamp())
}

/// Why a certificate was refused though its chain verified: it names no identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the certificate names no identity (no URI or DNS subject alternative name)")]
pub struct NoIdentity;
