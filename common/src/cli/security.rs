//! The flags of TLS and authorization, flattened into the programs' `Args`: a server's
//! ([`ServerTlsArgs`]: its certificate, its CA, how it treats clients, the plain address
//! beside the TLS one), a client's ([`ClientTlsArgs`], the driver's) and the policy file
//! ([`AuthzArgs`]). Each flag has its `RPCMESH_…` fallback and its default as a named
//! constant; validation reads the files once, so a program never starts on a certificate
//! it cannot use. [`Security`] is what a server runs with them: its TLS and its policy,
//! read again on SIGHUP and when their files change.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use crate::authz::Authz;
use crate::metrics::security::{DeniedCounters, FileReloads, TlsCounters};
use crate::metrics::{Role, Telemetry};
use crate::net::shutdown::CancellationToken;
use crate::net::tls::{ClientTls, ServerTls};
use crate::net::watch::{Trigger, watch};

use crate::cli::config::ConfigProblems;
use crate::cli::values::{DurationArg, OnOff};
use crate::net::tls::config::Material;
use crate::net::tls::{
    ClientAuth, ClientTlsSettings, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_MAX_HANDSHAKES,
    ServerTlsSettings, TlsFiles,
};

/// Client certificates are required unless told otherwise: a server given a certificate is
/// part of a mesh whose hops are mutual TLS, and anything weaker is a choice to write down.
pub const DEFAULT_CLIENT_AUTH: ClientAuth = ClientAuth::Required;

/// A server given a certificate speaks TLS on its main address unless told otherwise: the
/// hops are each their own choice, and `--listen-tls off` leaves the callers' hop plain.
pub const DEFAULT_LISTEN_TLS: bool = true;

/// A server's TLS flags.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct ServerTlsArgs {
    /// PEM certificate chain to present (with --tls-key: the main address speaks TLS).
    #[arg(long, env = "RPCMESH_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "RPCMESH_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificates that peers' certificates must chain to.
    #[arg(long, env = "RPCMESH_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificates: off, optional (verified when given), required.
    #[arg(long, env = "RPCMESH_TLS_CLIENT_AUTH", default_value_t = DEFAULT_CLIENT_AUTH)]
    pub tls_client_auth: ClientAuth,
    /// How long a TLS handshake may take.
    #[arg(long, env = "RPCMESH_TLS_HANDSHAKE_TIMEOUT", default_value_t = DurationArg(DEFAULT_HANDSHAKE_TIMEOUT))]
    pub tls_handshake_timeout: DurationArg,
    /// TLS handshakes in progress at once; more connections are closed at once.
    #[arg(long, env = "RPCMESH_TLS_MAX_HANDSHAKES", default_value_t = DEFAULT_MAX_HANDSHAKES)]
    pub tls_max_handshakes: usize,
    /// A second address, plain RPCF v1 without TLS, beside the TLS one (for v1 peers).
    #[arg(long, env = "RPCMESH_LISTEN_PLAIN")]
    pub listen_plain: Option<SocketAddr>,
    /// Speak TLS on the main address when a certificate is given: on|off (off: the
    /// certificate only identifies a broker to its providers, --upstream-tls).
    #[arg(long, env = "RPCMESH_LISTEN_TLS", default_value_t = OnOff(DEFAULT_LISTEN_TLS))]
    pub listen_tls: OnOff,
}

impl ServerTlsArgs {
    fn files(&self) -> TlsFiles {
        TlsFiles {
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
            ca: self.tls_ca.clone(),
        }
    }

    /// The server's TLS, `None` when no certificate is given; every problem (a missing
    /// key, files that do not load) goes to `p`.
    pub fn server(&self, p: &mut ConfigProblems) -> Option<ServerTlsSettings> {
        p.check(self.tls_max_handshakes == 0, || {
            "--tls-max-handshakes must be at least 1".into()
        });
        p.check(self.tls_handshake_timeout.0.is_zero(), || {
            "--tls-handshake-timeout must be above zero".into()
        });
        if (self.tls_cert.is_none() && self.tls_key.is_none()) || !self.listen_tls.0 {
            p.check(self.listen_plain.is_some(), || {
                "--listen-plain needs TLS on the main address (--tls-cert, --tls-key)".into()
            });
            return None;
        }
        let settings = ServerTlsSettings {
            files: self.files(),
            client_auth: self.tls_client_auth,
            handshake_timeout: self.tls_handshake_timeout.0,
            max_handshakes: self.tls_max_handshakes,
        };
        match Material::load(&settings.files).and_then(|m| m.server_config(settings.client_auth)) {
            Ok(_) => Some(settings),
            Err(e) => {
                p.0.push(format!("tls: {e}"));
                None
            }
        }
    }

    /// The same files as a client's (the broker towards its providers: its certificate
    /// identifies it, the CA verifies them); every problem goes to `p`.
    pub fn client(&self, p: &mut ConfigProblems) -> Option<ClientTlsSettings> {
        let settings = ClientTlsSettings {
            files: self.files(),
            server_name: None,
            handshake_timeout: self.tls_handshake_timeout.0,
        };
        check_client(settings, p)
    }
}

fn check_client(settings: ClientTlsSettings, p: &mut ConfigProblems) -> Option<ClientTlsSettings> {
    if settings.files.cert.is_some() != settings.files.key.is_some() {
        p.0.push("tls: --tls-cert and --tls-key go together".into());
        return None;
    }
    match Material::load(&settings.files).and_then(|m| m.client_config()) {
        Ok(_) => Some(settings),
        Err(e) => {
            p.0.push(format!("tls: {e}"));
            None
        }
    }
}

/// A client's TLS flags (the driver's).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct ClientTlsArgs {
    /// PEM CA certificates the targets' certificates must chain to: given, the driver
    /// speaks TLS.
    #[arg(long, env = "RPCMESH_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate to present (with --tls-key).
    #[arg(long, env = "RPCMESH_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "RPCMESH_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The name the targets' certificates must carry (default: each target's host).
    #[arg(long, env = "RPCMESH_TLS_SERVER_NAME")]
    pub tls_server_name: Option<String>,
}

impl ClientTlsArgs {
    /// The client's TLS, `None` without `--tls-ca`; every problem goes to `p`.
    pub fn client(&self, p: &mut ConfigProblems) -> Option<ClientTlsSettings> {
        if self.tls_ca.is_none() {
            p.check(self.tls_cert.is_some() || self.tls_key.is_some(), || {
                "--tls-cert and --tls-key need --tls-ca (the CA the targets chain to)".into()
            });
            return None;
        }
        check_client(
            ClientTlsSettings {
                files: TlsFiles {
                    cert: self.tls_cert.clone(),
                    key: self.tls_key.clone(),
                    ca: self.tls_ca.clone(),
                },
                server_name: self.tls_server_name.clone(),
                handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            },
            p,
        )
    }
}

/// The authorization policy flag.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct AuthzArgs {
    /// A TOML file of who may call which services and methods; once given, every other
    /// call is denied. Read again on SIGHUP and when it changes.
    #[arg(long, env = "RPCMESH_AUTHZ_POLICY")]
    pub authz_policy: Option<PathBuf>,
}

/// A server's TLS and policy while it runs: both read at the start, read again on SIGHUP
/// and when their files change (a file that fails to load is kept out, logged with what
/// is wrong and counted in `rpcmesh_file_reloads_total{result="error"}`; what was in force
/// stays), until `stop`.
#[derive(Debug, Clone)]
pub struct Security {
    /// The server's TLS, when it has it.
    pub tls: Option<Arc<ServerTls>>,
    /// The broker's TLS towards its providers, when it has it.
    pub upstream: Option<Arc<ClientTls>>,
    /// The policy, when one is set.
    pub authz: Option<Arc<Authz>>,
    /// Where denials are counted.
    pub denied: DeniedCounters,
}

/// What a server's [`Security::start`] is given.
#[derive(Debug, Clone, Default)]
pub struct SecuritySettings {
    /// Its TLS as a server.
    pub server: Option<ServerTlsSettings>,
    /// Its TLS as a client (the broker's towards providers).
    pub client: Option<ClientTlsSettings>,
    /// Its policy file.
    pub policy: Option<PathBuf>,
}

impl Security {
    /// A connection that came through `via` made ready for its session: the TLS handshake
    /// on the main address when the server has TLS (`Err` when it was refused, counted by
    /// [`ServerTls::accept`]), the socket as it is on a plain one; with the peer's identity.
    pub async fn accept(
        &self,
        tcp: tokio::net::TcpStream,
        peer: SocketAddr,
        via: crate::net::listener::Via,
    ) -> Result<crate::net::tls::Secured, crate::net::tls::Refusal> {
        match (&self.tls, via) {
            (Some(tls), crate::net::listener::Via::Main) => tls.accept(tcp, peer).await,
            _ => Ok(crate::net::tls::Secured {
                stream: crate::net::stream::Stream::Plain(tcp),
                identity: None,
            }),
        }
    }

    /// Loads what `settings` name and starts watching the files; the error says which file
    /// and what is wrong (validation read them already, so it means they changed since).
    pub fn start(
        role: Role,
        telemetry: &Telemetry,
        settings: SecuritySettings,
        stop: CancellationToken,
    ) -> Result<Security, String> {
        let tls = match settings.server {
            Some(s) => Some(
                ServerTls::new(s, TlsCounters::new(telemetry, role, "inbound"))
                    .map_err(|e| format!("tls: {e}"))?,
            ),
            None => None,
        };
        let upstream = match settings.client {
            Some(s) => Some(
                ClientTls::new(s, TlsCounters::new(telemetry, role, "upstream"))
                    .map_err(|e| format!("upstream tls: {e}"))?,
            ),
            None => None,
        };
        // Registered alike whatever is configured, so every program exports the families.
        let _ = TlsCounters::new(telemetry, role, "inbound");
        let tls_reloads = FileReloads::new(telemetry, role, "tls");
        let policy_reloads = FileReloads::new(telemetry, role, "policy");
        let authz = match &settings.policy {
            Some(p) => Some(Authz::load(p).map_err(|e| e.to_string())?),
            None => None,
        };
        let mut tls_paths: Vec<PathBuf> = tls.iter().flat_map(|t| t.paths()).collect();
        tls_paths.extend(upstream.iter().flat_map(|t| t.paths()));
        tls_paths.sort();
        tls_paths.dedup();
        let mut triggers = Vec::new();
        if !tls_paths.is_empty() {
            let trigger = Trigger::new();
            triggers.push(trigger.clone());
            let (server, client) = (tls.clone(), upstream.clone());
            tokio::spawn(watch(
                tls_paths,
                trigger,
                stop.child_token(),
                move |asked| {
                    let r = server
                        .iter()
                        .try_for_each(|t| t.reload())
                        .and_then(|()| client.iter().try_for_each(|t| t.reload()));
                    tls_reloads.read(r.is_ok());
                    match r {
                        Ok(()) => {
                            tracing::info!(asked, "tls files read again; new handshakes use them")
                        }
                        Err(e) => {
                            tracing::error!(error = %e, "tls files kept out; the previous ones stay in force")
                        }
                    }
                },
            ));
        }
        if let Some(a) = &authz {
            let trigger = Trigger::new();
            triggers.push(trigger.clone());
            let a = a.clone();
            let paths = vec![a.path().to_path_buf()];
            tokio::spawn(watch(paths, trigger, stop.child_token(), move |asked| {
                let r = a.reload();
                policy_reloads.read(r.is_ok());
                match r {
                    Ok(()) => tracing::info!(asked, "authorization policy read again"),
                    Err(e) => {
                        tracing::error!(error = %e, "authorization policy kept out; the previous one stays in force")
                    }
                }
            }));
        }
        if !triggers.is_empty() {
            on_sighup(triggers, stop);
        }
        Ok(Security {
            tls,
            upstream,
            authz,
            denied: DeniedCounters::new(telemetry, role),
        })
    }
}

/// Pulls every trigger on each SIGHUP until `stop` (a receiver of its own: the broker's
/// providers file listens too).
fn on_sighup(triggers: Vec<Trigger>, stop: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::hangup()) {
        Ok(mut hup) => {
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        got = hup.recv() => if got.is_none() { return },
                    }
                    for t in &triggers {
                        t.pull();
                    }
                }
            });
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; the tls and policy files are still read when they change")
        }
    }
}
