//! The TLS handshakes: a server's ([`ServerTls::accept`]) and a client's
//! ([`ClientTls::connect`]), each with its configuration read from files and replaced
//! whole when they change ([`ServerTls::reload`]: the next handshake uses the new files,
//! connections already open go on with theirs).
//!
//! A server's handshake runs in the connection's own task, never in the accept loop, so a
//! slow or silent client holds only itself. Each is bounded: in time (the handshake
//! timeout, 10 s by default) and in number (handshakes in progress at once; over the cap
//! a connection is closed at once). Every refusal has a reason ([`Refusal`]), is told to
//! the observer (the metrics layer counts it) and is logged through a thinned log line: a
//! peer can cause them at will.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ServerConfig};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

use crate::net::stream::{Stream, TlsStream};
use crate::net::thinned::Thinned;
use crate::net::tls::config::{ClientTlsSettings, Material, ServerTlsSettings, TlsError};
use crate::net::tls::identity::{Identity, NoIdentity};

/// The process's budget of refused-handshake log lines.
static REFUSED_LINES: Thinned = Thinned::new();

/// Why a handshake did not make a connection, as
/// `rpcmesh_tls_handshake_failures_total{reason}` counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// It did not finish within the handshake timeout (a client that stopped half-way,
    /// or never spoke).
    Timeout,
    /// Too many handshakes were in progress: closed at once.
    Busy,
    /// The bytes were not TLS (plaintext RPCF, HTTP...).
    NotTls,
    /// A client certificate is required and none was given.
    NoCertificate,
    /// The peer's certificate does not chain to the CA.
    UnknownCa,
    /// The peer's certificate has expired (or is not valid yet).
    Expired,
    /// The peer's certificate verified but names no identity.
    NoIdentity,
    /// The peer's certificate is unusable otherwise (wrong name, wrong key usage, bad
    /// encoding, revoked).
    BadCertificate,
    /// The peer refused us with an alert (it does not trust our certificate...).
    PeerAlert,
    /// The peer offers nothing we take (an older TLS version, no common cipher suite).
    Incompatible,
    /// The peer closed the connection before the handshake was done.
    Eof,
    /// Anything else (a socket error...).
    Other,
}

impl Refusal {
    /// Every reason, in the order of [`Refusal::index`].
    pub const ALL: [Refusal; 12] = [
        Refusal::Timeout,
        Refusal::Busy,
        Refusal::NotTls,
        Refusal::NoCertificate,
        Refusal::UnknownCa,
        Refusal::Expired,
        Refusal::NoIdentity,
        Refusal::BadCertificate,
        Refusal::PeerAlert,
        Refusal::Incompatible,
        Refusal::Eof,
        Refusal::Other,
    ];

    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Timeout => "timeout",
            Refusal::Busy => "busy",
            Refusal::NotTls => "not_tls",
            Refusal::NoCertificate => "no_certificate",
            Refusal::UnknownCa => "unknown_ca",
            Refusal::Expired => "expired",
            Refusal::NoIdentity => "no_identity",
            Refusal::BadCertificate => "bad_certificate",
            Refusal::PeerAlert => "peer_alert",
            Refusal::Incompatible => "incompatible",
            Refusal::Eof => "eof",
            Refusal::Other => "other",
        }
    }

    /// Position in [`Refusal::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The reason of a failed handshake's error (tokio-rustls wraps rustls's own errors in
    /// `io::ErrorKind::InvalidData`).
    pub fn of(e: &io::Error) -> Refusal {
        use rustls::{CertificateError as C, Error as E, InvalidMessage as M};
        let Some(tls) = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) else {
            return match e.kind() {
                io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe => Refusal::Eof,
                io::ErrorKind::TimedOut => Refusal::Timeout,
                _ => Refusal::Other,
            };
        };
        match tls {
            E::InvalidMessage(M::InvalidContentType | M::UnknownProtocolVersion)
            | E::InvalidMessage(M::MessageTooLarge) => Refusal::NotTls,
            E::InvalidMessage(_) | E::InappropriateMessage { .. } => Refusal::NotTls,
            E::NoCertificatesPresented => Refusal::NoCertificate,
            E::InvalidCertificate(c) => match c {
                C::UnknownIssuer | C::BadSignature => Refusal::UnknownCa,
                C::Expired
                | C::ExpiredContext { .. }
                | C::NotValidYet
                | C::NotValidYetContext { .. } => Refusal::Expired,
                C::Other(o) if o.0.downcast_ref::<NoIdentity>().is_some() => Refusal::NoIdentity,
                _ => Refusal::BadCertificate,
            },
            E::AlertReceived(_) => Refusal::PeerAlert,
            E::PeerIncompatible(_) | E::NoApplicationProtocol => Refusal::Incompatible,
            E::PeerMisbehaved(_) => Refusal::NotTls,
            _ => Refusal::Other,
        }
    }
}

/// Which certificate an expiry is of (`rpcmesh_tls_cert_expiry_timestamp_seconds{cert}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CertKind {
    /// The program's own certificate.
    Own,
    /// The earliest-expiring certificate of its CA file.
    Ca,
}

impl CertKind {
    /// The `cert` label.
    pub fn label(self) -> &'static str {
        match self {
            CertKind::Own => "own",
            CertKind::Ca => "ca",
        }
    }
}

/// Hooks the handshakes call, for metrics.
pub trait TlsObserver: Send + Sync + 'static {
    /// A handshake made a connection.
    fn handshake_done(&self) {}
    /// A handshake was refused, for `reason`.
    fn handshake_failed(&self, _reason: Refusal) {}
    /// The files were read: `kind`'s certificate expires at `unix_seconds`.
    fn expires(&self, _kind: CertKind, _unix_seconds: i64) {}
}

/// An observer that does nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoTlsObserver;
impl TlsObserver for NoTlsObserver {}

/// A connection past its handshake: the stream, and whom the peer's certificate names
/// (`None`: it presented none, which client auth `optional` allows).
#[derive(Debug)]
pub struct Secured {
    /// The socket with its TLS.
    pub stream: Stream,
    /// The peer's identity.
    pub identity: Option<Identity>,
}

fn peer_identity(conn: &rustls::Connection) -> Option<Identity> {
    conn.peer_certificates()
        .and_then(|c| c.first())
        .and_then(|c| Identity::of_certificate(c))
}

fn tell_expiry(observer: &dyn TlsObserver, m: &Material) {
    if let Some(t) = m.cert_expiry {
        observer.expires(CertKind::Own, t);
    }
    if let Some(t) = m.ca_expiry {
        observer.expires(CertKind::Ca, t);
    }
}

/// A server's TLS: its configuration (replaced on reload), the cap on handshakes in
/// progress, and the observer.
pub struct ServerTls {
    settings: ServerTlsSettings,
    config: ArcSwap<ServerConfig>,
    slots: Arc<Semaphore>,
    observer: Arc<dyn TlsObserver>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Reads the files and builds the first configuration.
    pub fn new(
        settings: ServerTlsSettings,
        observer: Arc<dyn TlsObserver>,
    ) -> Result<Arc<ServerTls>, TlsError> {
        let material = Material::load(&settings.files)?;
        let config = material.server_config(settings.client_auth)?;
        tell_expiry(&*observer, &material);
        if let Some(id) = &material.identity {
            tracing::info!(identity = %id, client_auth = %settings.client_auth, "tls: serving as");
        }
        Ok(Arc::new(ServerTls {
            slots: Arc::new(Semaphore::new(settings.max_handshakes)),
            settings,
            config: ArcSwap::new(config),
            observer,
        }))
    }

    /// The files, to watch.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.settings.files.paths()
    }

    /// Reads the files again: on success the next handshakes use them; on error the
    /// configuration stays as it was.
    pub fn reload(&self) -> Result<(), TlsError> {
        let material = Material::load(&self.settings.files)?;
        let config = material.server_config(self.settings.client_auth)?;
        self.config.store(config);
        tell_expiry(&*self.observer, &material);
        Ok(())
    }

    /// The handshake of an accepted connection from `peer`, within the timeout and the
    /// cap; the refusal is counted and logged (thinned).
    pub async fn accept(&self, tcp: TcpStream, peer: SocketAddr) -> Result<Secured, Refusal> {
        let r = self.handshake(tcp).await;
        match &r {
            Ok(s) => self.opened(peer, s.identity.as_ref()),
            Err((reason, error)) => self.refused(peer, *reason, error),
        }
        r.map_err(|(reason, _)| reason)
    }

    /// A connection made by a handshake with `peer`: counted and logged.
    pub fn opened(&self, peer: SocketAddr, identity: Option<&Identity>) {
        self.observer.handshake_done();
        let identity = identity.map_or("anonymous", |i| i.as_str());
        tracing::info!(%peer, identity, "tls connection opened");
    }

    /// A handshake with `peer` refused for `reason`: counted, and logged (thinned).
    pub fn refused(&self, peer: SocketAddr, reason: Refusal, error: &io::Error) {
        self.observer.handshake_failed(reason);
        match REFUSED_LINES.admit() {
            Some(a) => {
                tracing::warn!(%peer, reason = reason.label(), %error, refused = a.seen, left_out = a.left_out, "tls handshake refused")
            }
            None => {
                tracing::debug!(%peer, reason = reason.label(), %error, "tls handshake refused")
            }
        }
    }

    /// A handshake its caller drives itself (the broker's loop engine, on a socket of its
    /// own): the server side of a connection under the configuration in force, and its
    /// place among the handshakes in progress, held until it is done or refused, which
    /// it must be within [`ServerTls::handshake_timeout`]. Over the cap, refused
    /// ([`Refusal::Busy`]; not yet counted: [`ServerTls::refused`] does).
    pub fn begin(&self) -> Result<(rustls::ServerConnection, HandshakeSlot), (Refusal, io::Error)> {
        let slot = self.slot()?;
        let conn = rustls::ServerConnection::new(self.config.load_full())
            .map_err(|e| (Refusal::Other, io::Error::other(e)))?;
        Ok((conn, HandshakeSlot(slot)))
    }

    /// How long a handshake may take.
    pub fn handshake_timeout(&self) -> std::time::Duration {
        self.settings.handshake_timeout
    }

    /// Whom the certificate the peer of `conn` presented names, once its handshake is
    /// done.
    pub fn identity_of(conn: &rustls::Connection) -> Option<Identity> {
        peer_identity(conn)
    }

    fn slot(&self) -> Result<tokio::sync::OwnedSemaphorePermit, (Refusal, io::Error)> {
        self.slots.clone().try_acquire_owned().map_err(|_| {
            let e = io::Error::other(format!(
                "{} handshakes in progress already",
                self.settings.max_handshakes
            ));
            (Refusal::Busy, e)
        })
    }

    async fn handshake(&self, tcp: TcpStream) -> Result<Secured, (Refusal, io::Error)> {
        let _slot = self.slot()?;
        let acceptor = tokio_rustls::TlsAcceptor::from(self.config.load_full());
        let done =
            tokio::time::timeout(self.settings.handshake_timeout, acceptor.accept(tcp)).await;
        let tls = match done {
            Err(_) => {
                let e = io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("not done within {:?}", self.settings.handshake_timeout),
                );
                return Err((Refusal::Timeout, e));
            }
            Ok(Err(e)) => return Err((Refusal::of(&e), e)),
            Ok(Ok(tls)) => tls,
        };
        let (tcp, conn) = tls.into_inner();
        let conn = rustls::Connection::Server(conn);
        let identity = peer_identity(&conn);
        Ok(Secured {
            stream: Stream::Tls(Box::new(TlsStream::new(tcp, conn))),
            identity,
        })
    }
}

/// A handshake's place among those in progress ([`ServerTls::begin`]), given back when
/// dropped.
#[derive(Debug)]
pub struct HandshakeSlot(#[allow(dead_code)] tokio::sync::OwnedSemaphorePermit);

/// Why a client's handshake made no connection.
#[derive(Debug, thiserror::Error)]
#[error("tls handshake with {server} refused ({}): {error}", .reason.label())]
pub struct ConnectError {
    /// The name the server was to prove.
    pub server: String,
    /// Why, as counted.
    pub reason: Refusal,
    /// What rustls or the socket said.
    pub error: io::Error,
}

/// A client's TLS: its configuration (replaced on reload) and the observer.
pub struct ClientTls {
    settings: ClientTlsSettings,
    config: ArcSwap<ClientConfig>,
    observer: Arc<dyn TlsObserver>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    /// Reads the files and builds the first configuration.
    pub fn new(
        settings: ClientTlsSettings,
        observer: Arc<dyn TlsObserver>,
    ) -> Result<Arc<ClientTls>, TlsError> {
        let material = Material::load(&settings.files)?;
        let config = material.client_config()?;
        tell_expiry(&*observer, &material);
        Ok(Arc::new(ClientTls {
            settings,
            config: ArcSwap::new(config),
            observer,
        }))
    }

    /// The files, to watch.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.settings.files.paths()
    }

    /// Reads the files again (see [`ServerTls::reload`]).
    pub fn reload(&self) -> Result<(), TlsError> {
        let material = Material::load(&self.settings.files)?;
        self.config.store(material.client_config()?);
        tell_expiry(&*self.observer, &material);
        Ok(())
    }

    /// The handshake over a connected socket to `addr` (`HOST:PORT`): the server must
    /// prove the host's name (or the configured server name). Counted; logging is the
    /// caller's, which knows how often it reconnects.
    pub async fn connect(&self, tcp: TcpStream, addr: &str) -> Result<Secured, ConnectError> {
        let name = self.name_of(addr);
        let r = self.handshake(tcp, &name).await;
        match &r {
            Ok(_) => self.observer.handshake_done(),
            Err(e) => self.observer.handshake_failed(e.reason),
        }
        r
    }

    /// A handshake its caller drives itself (the broker's loop engine, on a socket of its
    /// own): the client side of a connection to `addr` under the configuration in force,
    /// which must be done within [`ClientTls::handshake_timeout`], and told how it ended
    /// ([`ClientTls::done`], [`ClientTls::failed`]) to be counted.
    pub fn begin(&self, addr: &str) -> Result<rustls::ClientConnection, ConnectError> {
        let name = self.name_of(addr);
        let server = server_name(&name)?;
        rustls::ClientConnection::new(self.config.load_full(), server).map_err(|e| ConnectError {
            server: name,
            reason: Refusal::Other,
            error: io::Error::other(e),
        })
    }

    /// The name a server at `addr` must prove: the configured one, else its host.
    fn name_of(&self, addr: &str) -> String {
        self.settings
            .server_name
            .clone()
            .unwrap_or_else(|| host_of(addr).to_string())
    }

    /// How long a handshake may take.
    pub fn handshake_timeout(&self) -> std::time::Duration {
        self.settings.handshake_timeout
    }

    /// A handshake begun with [`ClientTls::begin`] made a connection.
    pub fn done(&self) {
        self.observer.handshake_done();
    }

    /// A handshake begun with [`ClientTls::begin`] was refused, for `reason`.
    pub fn failed(&self, reason: Refusal) {
        self.observer.handshake_failed(reason);
    }

    async fn handshake(&self, tcp: TcpStream, name: &str) -> Result<Secured, ConnectError> {
        let fail = |reason, error| ConnectError {
            server: name.to_string(),
            reason,
            error,
        };
        let server = server_name(name)?;
        let connector = tokio_rustls::TlsConnector::from(self.config.load_full());
        let timeout = self.settings.handshake_timeout;
        let tls = match tokio::time::timeout(timeout, connector.connect(server, tcp)).await {
            Err(_) => {
                let e = io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("not done within {timeout:?}"),
                );
                return Err(fail(Refusal::Timeout, e));
            }
            Ok(Err(e)) => return Err(fail(Refusal::of(&e), e)),
            Ok(Ok(tls)) => tls,
        };
        let (tcp, conn) = tls.into_inner();
        let conn = rustls::Connection::Client(conn);
        let identity = peer_identity(&conn);
        Ok(Secured {
            stream: Stream::Tls(Box::new(TlsStream::new(tcp, conn))),
            identity,
        })
    }
}

/// `name` as the name a server must prove; refused as a bad certificate's when it is no
/// DNS name or IP address.
fn server_name(name: &str) -> Result<ServerName<'static>, ConnectError> {
    ServerName::try_from(name.to_string()).map_err(|e| ConnectError {
        server: name.to_string(),
        reason: Refusal::BadCertificate,
        error: io::Error::new(io::ErrorKind::InvalidInput, e),
    })
}

/// The host of `HOST:PORT` (`[v6]:PORT` too); the whole text when it has no port.
pub fn host_of(addr: &str) -> &str {
    let host = match addr.rsplit_once(':') {
        Some((h, p)) if p.parse::<u16>().is_ok() => h,
        _ => addr,
    };
    host.trim_start_matches('[').trim_end_matches(']')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_of_an_address_is_its_name_or_ip() {
        assert_eq!(host_of("127.0.0.1:7700"), "127.0.0.1");
        assert_eq!(host_of("broker.example:7700"), "broker.example");
        assert_eq!(host_of("[::1]:7700"), "::1");
        assert_eq!(host_of("broker.example"), "broker.example");
    }

    #[test]
    fn every_refusal_has_its_own_label() {
        let labels: std::collections::HashSet<_> = Refusal::ALL.iter().map(|r| r.label()).collect();
        assert_eq!(labels.len(), Refusal::ALL.len());
        for (i, r) in Refusal::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
    }
}
