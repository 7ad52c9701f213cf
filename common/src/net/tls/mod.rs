//! TLS on rpcmesh's connections, each hop on its own: the files ([`config`]), the
//! handshakes and their refusals ([`handshake`]), and whom a peer's certificate names
//! ([`identity`]).
//!
//! A connection's bytes after the handshake are [`crate::net::stream`]'s; when the files
//! are read again is [`crate::net::watch`]'s. Authorization (who may call what) is above
//! this layer: here a peer only gets a name.

pub mod config;
pub mod handshake;
pub mod identity;

pub use config::{
    ClientAuth, ClientTlsSettings, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_MAX_HANDSHAKES,
    ServerTlsSettings, TlsError, TlsFiles,
};
pub use handshake::{
    CertKind, ClientTls, ConnectError, NoTlsObserver, Refusal, Secured, ServerTls, TlsObserver,
};
pub use identity::Identity;
