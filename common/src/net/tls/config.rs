//! TLS settings and what they are made of: the files (a certificate chain, its key, the
//! CA roots peers must chain to), read and checked, and the rustls configurations built
//! from them for each side.
//!
//! The rules every configuration here keeps:
//!
//! - **TLS 1.3 only**, with rustls's `ring` provider: no protocol downgrade to argue about,
//!   one round trip per handshake, forward secrecy always.
//! - **A server's certificate identifies it** to clients, and, for the broker, to its
//!   providers as well: the same chain and key serve both sides.
//! - **A client certificate is verified against `--tls-ca`** and must name an identity
//!   (`crate::net::tls::identity`): a chain that verifies but names no one is refused at
//!   the handshake, so that nothing above ever sees an unnamed peer.
//! - **A server is verified by name**: its certificate must carry the DNS name or IP
//!   address the client dialled (or the name the client was told to expect).
//!
//! Files are bounded ([`MAX_PEM_BYTES`]) and every problem says which file and what.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, OtherError,
    RootCertStore, ServerConfig, SignatureScheme,
};

use crate::net::tls::identity::{self, Identity, NoIdentity};

/// The largest certificate, key or CA file read: 1 MiB holds hundreds of certificates; a
/// larger file is a mistake (a wrong path), not a bundle.
pub const MAX_PEM_BYTES: u64 = 1 << 20;
/// How long a TLS handshake may take, from the accept to its last message: 10 s, as the
/// frame timeout (`net::session::DEFAULT_FRAME_TIMEOUT`); a healthy one takes a round trip
/// and a millisecond of CPU, so only a peer that stopped or trickles is cut.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// TLS handshakes in progress at once on one server; over it, a connection is closed at
/// once (counted `reason="busy"`) and its client reconnects after its back-off. A
/// handshake holds up to 64 KiB of rustls's buffers and a millisecond of CPU at most, so
/// 256 of them bound that to 16 MiB and a quarter of a second of one core, while a driver's
/// 200 connections opened together (the reference workload) all get in.
pub const DEFAULT_MAX_HANDSHAKES: usize = 256;

/// Whether a server asks its clients for a certificate (`--tls-client-auth`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ClientAuth {
    /// No client certificate is asked for: every caller is anonymous.
    Off,
    /// One is asked for and verified when given; a caller without one is anonymous.
    Optional,
    /// One is required, verified against `--tls-ca`, and must name an identity.
    Required,
}

impl FromStr for ClientAuth {
    type Err = String;
    fn from_str(s: &str) -> Result<ClientAuth, String> {
        match s.to_ascii_lowercase().as_str() {
            "off" => Ok(ClientAuth::Off),
            "optional" => Ok(ClientAuth::Optional),
            "required" => Ok(ClientAuth::Required),
            _ => Err(format!("{s:?} is not off, optional or required")),
        }
    }
}

impl fmt::Display for ClientAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ClientAuth::Off => "off",
            ClientAuth::Optional => "optional",
            ClientAuth::Required => "required",
        })
    }
}

/// The files of one side's TLS.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM certificate chain, the program's own first (`--tls-cert`).
    pub cert: Option<PathBuf>,
    /// PEM private key of that certificate (PKCS#8, PKCS#1 or SEC1; `--tls-key`).
    pub key: Option<PathBuf>,
    /// PEM CA certificates peers must chain to (`--tls-ca`).
    pub ca: Option<PathBuf>,
}

impl TlsFiles {
    /// The files that are set, to watch for changes.
    pub fn paths(&self) -> Vec<PathBuf> {
        [&self.cert, &self.key, &self.ca]
            .into_iter()
            .flatten()
            .cloned()
            .collect()
    }
}

/// A server's TLS: its files and how it treats clients.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerTlsSettings {
    /// Its certificate and key (both required), and the CA for client certificates
    /// (required unless client auth is off).
    pub files: TlsFiles,
    /// Whether clients must present a certificate.
    pub client_auth: ClientAuth,
    /// How long a handshake may take.
    pub handshake_timeout: Duration,
    /// Handshakes in progress at once.
    pub max_handshakes: usize,
}

/// A client's TLS: the CA its servers must chain to (required) and, optionally, its own
/// certificate and key to present.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientTlsSettings {
    /// CA (required), certificate and key (both or neither).
    pub files: TlsFiles,
    /// The name servers' certificates must carry, instead of the host dialled.
    pub server_name: Option<String>,
    /// How long a handshake may take.
    pub handshake_timeout: Duration,
}

/// Why TLS material could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A file is larger than [`MAX_PEM_BYTES`].
    #[error("{path} is over {MAX_PEM_BYTES} bytes")]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// A file holds no PEM section of the kind wanted, or a broken one.
    #[error("{path}: {what}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// A setting needs a file that was not given.
    #[error("{0}")]
    Missing(&'static str),
    /// rustls refused the material (a key that does not match its certificate...).
    #[error("{0}")]
    Rustls(#[from] rustls::Error),
    /// The CA file's certificates cannot verify clients.
    #[error("client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// Certificates and keys read from their files, and when they expire.
#[derive(Debug)]
pub struct Material {
    /// The program's chain (empty when no certificate is given).
    pub chain: Vec<CertificateDer<'static>>,
    /// Its key.
    pub key: Option<PrivateKeyDer<'static>>,
    /// The CA roots, when a CA file is given.
    pub roots: Option<Arc<RootCertStore>>,
    /// The end of the program's certificate's validity (Unix seconds).
    pub cert_expiry: Option<i64>,
    /// The earliest end of validity of the CA file's certificates (Unix seconds).
    pub ca_expiry: Option<i64>,
    /// The identity the program's certificate names.
    pub identity: Option<Identity>,
}

/// Reads a PEM file, bounded.
fn read_pem(path: &Path) -> Result<Vec<u8>, TlsError> {
    use std::io::Read;
    let read = |source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    };
    let f = crate::files::open_regular(path).map_err(read)?;
    let mut bytes = Vec::new();
    f.take(MAX_PEM_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read)?;
    if bytes.len() as u64 > MAX_PEM_BYTES {
        return Err(TlsError::TooLarge {
            path: path.to_path_buf(),
        });
    }
    Ok(bytes)
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read_pem(path)?;
    let bad = |what: String| TlsError::Pem {
        path: path.to_path_buf(),
        what,
    };
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("bad PEM: {e}")))?;
    if certs.is_empty() {
        return Err(bad("no CERTIFICATE section".into()));
    }
    Ok(certs)
}

impl Material {
    /// Reads the files that are set.
    pub fn load(files: &TlsFiles) -> Result<Material, TlsError> {
        let chain = match &files.cert {
            Some(p) => certificates(p)?,
            None => Vec::new(),
        };
        let key = match &files.key {
            Some(p) => {
                let pem = read_pem(p)?;
                Some(
                    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| TlsError::Pem {
                        path: p.clone(),
                        what: format!("no usable PRIVATE KEY section: {e}"),
                    })?,
                )
            }
            None => None,
        };
        let (roots, ca_expiry) = match &files.ca {
            Some(p) => {
                let certs = certificates(p)?;
                let expiry = certs.iter().filter_map(|c| identity::not_after(c)).min();
                let mut store = RootCertStore::empty();
                let (added, _) = store.add_parsable_certificates(certs);
                if added == 0 {
                    return Err(TlsError::Pem {
                        path: p.clone(),
                        what: "no certificate usable as a CA root".into(),
                    });
                }
                (Some(Arc::new(store)), expiry)
            }
            None => (None, None),
        };
        let first = chain.first();
        Ok(Material {
            cert_expiry: first.and_then(|c| identity::not_after(c)),
            identity: first.and_then(|c| Identity::of_certificate(c)),
            chain,
            key,
            roots,
            ca_expiry,
        })
    }

    fn own(&self) -> Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
        let key = self.key.as_ref()?;
        (!self.chain.is_empty()).then(|| (self.chain.clone(), key.clone_key()))
    }

    /// The server configuration: this certificate, clients treated per `auth`.
    pub fn server_config(&self, auth: ClientAuth) -> Result<Arc<ServerConfig>, TlsError> {
        let provider = provider();
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?;
        let builder = match auth {
            ClientAuth::Off => builder.with_no_client_auth(),
            ClientAuth::Optional | ClientAuth::Required => {
                let roots = self.roots.clone().ok_or(TlsError::Missing(
                    "--tls-client-auth optional or required needs --tls-ca",
                ))?;
                let webpki = WebPkiClientVerifier::builder_with_provider(roots, provider);
                let webpki = match auth {
                    ClientAuth::Optional => webpki.allow_unauthenticated(),
                    _ => webpki,
                };
                builder.with_client_cert_verifier(Arc::new(NamedClients(webpki.build()?)))
            }
        };
        let (chain, key) = self.own().ok_or(TlsError::Missing(
            "a TLS server needs --tls-cert and --tls-key",
        ))?;
        Ok(Arc::new(builder.with_single_cert(chain, key)?))
    }

    /// The client configuration: servers verified against the CA, this certificate
    /// presented when there is one.
    pub fn client_config(&self) -> Result<Arc<ClientConfig>, TlsError> {
        let roots = self
            .roots
            .clone()
            .ok_or(TlsError::Missing("a TLS client needs --tls-ca"))?;
        let builder = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots);
        let config = match self.own() {
            Some((chain, key)) => builder.with_client_auth_cert(chain, key)?,
            None => builder.with_no_client_auth(),
        };
        Ok(Arc::new(config))
    }
}

/// rustls's `ring` provider: it builds with a C compiler alone on every target rustls
/// runs on (aws-lc-rs needs CMake and bindgen off the main Linux targets, and compiles a
/// far larger C library), and its constant-time AES-GCM, ChaCha20-Poly1305, X25519 and
/// P-256 are what TLS 1.3 between our own programs uses. What it lacks: FIPS validation
/// and post-quantum key exchange (docs/security.md).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The client verifier every server uses: webpki's, then the rule that a verified
/// certificate names an identity.
#[derive(Debug)]
struct NamedClients(Arc<dyn ClientCertVerifier>);

impl ClientCertVerifier for NamedClients {
    fn offer_client_auth(&self) -> bool {
        self.0.offer_client_auth()
    }
    fn client_auth_mandatory(&self) -> bool {
        self.0.client_auth_mandatory()
    }
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.0.root_hint_subjects()
    }
    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self.0.verify_client_cert(end_entity, intermediates, now)?;
        match Identity::of_certificate(end_entity) {
            Some(_) => Ok(verified),
            None => Err(rustls::Error::InvalidCertificate(CertificateError::Other(
                OtherError(Arc::new(NoIdentity)),
            ))),
        }
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}
