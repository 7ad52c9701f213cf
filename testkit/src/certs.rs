//! Test certificates: a CA and the certificates it issues (servers' and clients', with a
//! SPIFFE ID, a DNS name or no identity at all, expired or not), written as PEM files in
//! a folder of the test's, for the programs' `--tls-*` flags. Made with rcgen, so the fast
//! tier needs no outside tool; docs/security.md shows the same with openssl.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType,
};

/// The trust domain of the test certificates' SPIFFE IDs.
pub const TRUST_DOMAIN: &str = "rpcmesh.test";

/// The SPIFFE ID `spiffe://rpcmesh.test/ROLE/NAME`.
pub fn spiffe(role: &str, name: &str) -> String {
    format!("spiffe://{TRUST_DOMAIN}/{role}/{name}")
}

/// A certificate and its key, as files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    /// The PEM certificate (the chain: the leaf alone, issued by the CA directly).
    pub cert: PathBuf,
    /// Its PEM private key (PKCS#8).
    pub key: PathBuf,
}

/// What a certificate names, and how long it is valid.
#[derive(Debug, Clone)]
pub struct Leaf {
    /// File names' stem.
    pub name: String,
    /// A URI SAN (a SPIFFE ID), if any.
    pub uri: Option<String>,
    /// A DNS SAN, if any.
    pub dns: Option<String>,
    /// An IP SAN for 127.0.0.1 (what a client dialling 127.0.0.1 checks).
    pub localhost_ip: bool,
    /// Expired a year ago.
    pub expired: bool,
}

impl Leaf {
    /// A certificate for `spiffe://rpcmesh.test/ROLE/NAME`, valid for 127.0.0.1 too.
    pub fn spiffe(role: &str, name: &str) -> Leaf {
        Leaf {
            name: format!("{role}-{name}"),
            uri: Some(spiffe(role, name)),
            dns: Some("localhost".into()),
            localhost_ip: true,
            expired: false,
        }
    }

    /// The same, expired.
    pub fn expired(mut self) -> Leaf {
        self.expired = true;
        self.name.push_str("-expired");
        self
    }

    /// A certificate that names nobody: no URI, DNS or IP name.
    pub fn anonymous(name: &str) -> Leaf {
        Leaf {
            name: name.into(),
            uri: None,
            dns: None,
            localhost_ip: false,
            expired: false,
        }
    }
}

/// A CA of the test's, writing its files in `dir`.
pub struct Pki {
    dir: PathBuf,
    ca: rcgen::Certificate,
    ca_key: KeyPair,
    /// The CA certificate's file.
    pub ca_file: PathBuf,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki")
            .field("ca_file", &self.ca_file)
            .finish_non_exhaustive()
    }
}

impl Pki {
    /// A new CA named `name`, its files under `dir` (made if missing).
    pub fn new(dir: &Path, name: &str) -> Pki {
        std::fs::create_dir_all(dir).expect("make the certificates' folder");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_key = KeyPair::generate().expect("a CA key");
        let ca = params.self_signed(&ca_key).expect("the CA certificate");
        let ca_file = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&ca_file, ca.pem()).expect("write the CA file");
        Pki {
            dir: dir.to_path_buf(),
            ca,
            ca_key,
            ca_file,
        }
    }

    /// Issues `leaf` (usable by servers and clients alike) and writes its files.
    pub fn issue(&self, leaf: &Leaf) -> CertFiles {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("leaf params");
        params
            .distinguished_name
            .push(DnType::CommonName, leaf.name.as_str());
        let mut sans = Vec::new();
        if let Some(u) = &leaf.uri {
            sans.push(SanType::URI(u.as_str().try_into().expect("an ASCII URI")));
        }
        if let Some(d) = &leaf.dns {
            sans.push(SanType::DnsName(
                d.as_str().try_into().expect("an ASCII name"),
            ));
        }
        if leaf.localhost_ip {
            sans.push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        }
        params.subject_alt_names = sans;
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        if leaf.expired {
            params.not_before = rcgen::date_time_ymd(2000, 1, 1);
            params.not_after = rcgen::date_time_ymd(2001, 1, 1);
        }
        let key = KeyPair::generate().expect("a leaf key");
        let cert = params
            .signed_by(&key, &self.ca, &self.ca_key)
            .expect("the leaf certificate");
        let files = CertFiles {
            cert: self.dir.join(format!("{}.pem", leaf.name)),
            key: self.dir.join(format!("{}.key", leaf.name)),
        };
        std::fs::write(&files.cert, cert.pem()).expect("write the certificate");
        std::fs::write(&files.key, key.serialize_pem()).expect("write the key");
        files
    }
}
