//! The local mesh of a capacity run: a provider and a broker (two pairs with
//! `--compare-tls`: one plaintext, one with mutual TLS on both hops), each its own process
//! (the driver binary re-run as `driver serve provider|broker ...`, which is the provider's
//! or broker's own `main`), so that each one's CPU is its own and is read from its own
//! `/metrics`, as on separate hosts. Both bind port 0 and say where on stdout; both are
//! stopped (SIGTERM, then SIGKILL) when the mesh is dropped, and die with the driver: each
//! holds a pipe from it on stdin, and drains and exits when that pipe closes (as it does
//! when the driver ends in any way, SIGKILL included).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use rpcmesh_common::cli::startup::parse_listening_line;

use super::pki::{CertFiles, LocalPki};
use crate::config::ServeRole;

/// Worker threads of each local server: one, as in the driver's embedded mesh, so that on
/// a small machine the three processes do not fight over more cores than there are.
pub const LOCAL_THREADS: usize = 1;
/// How long a local server may take to say it listens.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a local server may take to drain and exit after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// A running server process.
#[derive(Debug)]
pub struct LocalServer {
    /// Where it takes calls.
    pub rpc: SocketAddr,
    /// Where its `/metrics` is.
    pub metrics: SocketAddr,
    child: Child,
}

/// The local provider and broker. Dropping it stops the broker, then the provider
/// (fields drop in order).
#[derive(Debug)]
pub struct LocalMesh {
    /// The broker (stopped first).
    pub broker: LocalServer,
    /// The provider.
    pub provider: LocalServer,
}

impl LocalMesh {
    /// Starts a provider (with `provider_flags`, e.g. `--service-time 1ms --service-work`)
    /// and a broker in front of it, from the driver binary `exe`; with `tls`, both speak
    /// mutual TLS on both hops with its certificates (`--tls-client-auth required`,
    /// `--upstream-tls on`).
    pub fn start(
        exe: &Path,
        provider_flags: &[String],
        tls: Option<&LocalPki>,
    ) -> anyhow::Result<LocalMesh> {
        let threads = LOCAL_THREADS.to_string();
        let tls_flags = |c: &CertFiles, ca: &Path| -> Vec<String> {
            let path = |p: &Path| p.display().to_string();
            vec![
                "--tls-cert".into(),
                path(&c.cert),
                "--tls-key".into(),
                path(&c.key),
                "--tls-ca".into(),
                path(ca),
                "--tls-client-auth".into(),
                "required".into(),
            ]
        };
        let mut flags: Vec<String> = ["--threads", &threads].map(String::from).to_vec();
        flags.extend(provider_flags.iter().cloned());
        if let Some(pki) = tls {
            flags.extend(tls_flags(&pki.provider, &pki.ca));
        }
        let provider = LocalServer::start(exe, ServeRole::Provider, &flags)?;
        let upstream = provider.rpc.to_string();
        let mut flags: Vec<String> = ["--threads", &threads, "--upstream", &upstream]
            .map(String::from)
            .to_vec();
        if let Some(pki) = tls {
            flags.extend(tls_flags(&pki.broker, &pki.ca));
            flags.extend(["--upstream-tls".into(), "on".into()]);
        }
        let broker = LocalServer::start(exe, ServeRole::Broker, &flags)?;
        Ok(LocalMesh { broker, provider })
    }
}

impl LocalServer {
    fn start(exe: &Path, role: ServeRole, flags: &[String]) -> anyhow::Result<LocalServer> {
        let mut cmd = Command::new(exe);
        cmd.args([
            "serve",
            role.name(),
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .args(flags)
        .stdin(Stdio::piped())
        // Its own process group: a Ctrl-C at the terminal is the driver's to handle (it
        // ends the experiment and stops the mesh), not the servers'.
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        // The driver's own settings (RPCMESH_COMPRESS, ...) are not the servers'.
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("RPCMESH_") {
                cmd.env_remove(k);
            }
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting the local {role} ({})", exe.display()))?;
        let stdout = child.stdout.take().context("the child's stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            for line in lines.by_ref().map_while(Result::ok) {
                if let Some(addrs) = parse_listening_line(&line) {
                    let _ = tx.send(addrs);
                    break;
                }
            }
            // Keep draining, so that the child never blocks on a full pipe.
            for _ in lines {}
        });
        let give_up = Instant::now() + START_TIMEOUT;
        let got = rx.recv_timeout(give_up.saturating_duration_since(Instant::now()));
        let mut server = LocalServer {
            rpc: "0.0.0.0:0".parse()?,
            metrics: "0.0.0.0:0".parse()?,
            child,
        };
        match got {
            Ok((rpc, Some(metrics))) => {
                server.rpc = rpc;
                server.metrics = metrics;
                Ok(server)
            }
            Ok((_, None)) => anyhow::bail!("the local {role} serves no /metrics"),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                // Its stdout closed without the line: it exited (bad flags, say).
                let status = server.child.wait().map(|s| s.to_string());
                anyhow::bail!(
                    "the local {role} exited before it listened ({}); its stderr is above",
                    status.unwrap_or_else(|e| e.to_string())
                )
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => anyhow::bail!(
                "the local {role} did not say where it listens within {START_TIMEOUT:?}"
            ),
        }
    }

    fn stop(&mut self) {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32);
        if let Some(pid) = pid {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let give_up = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < give_up {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for LocalServer {
    /// Stops it and reaps it, whatever happened (a server whose peer failed to start, too).
    fn drop(&mut self) {
        self.stop();
    }
}

/// `driver serve provider|broker FLAGS`: run as that program (its own flags, its own
/// `main`), dying with the parent. Used by [`LocalMesh`]; hidden from `--help`.
pub fn serve(role: ServeRole, flags: &[String]) -> anyhow::Result<()> {
    use clap::Parser;
    // When the driver ends (even by SIGKILL) its end of stdin closes: drain and exit, as
    // on SIGTERM. (Not PR_SET_PDEATHSIG: it fires when the parent *thread* ends.)
    std::thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
        let _ =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::TERM);
    });
    let argv = std::iter::once(role.name().to_string()).chain(flags.iter().cloned());
    match role {
        ServeRole::Provider => {
            rpcmesh_provider::main_with(&rpcmesh_provider::Args::try_parse_from(argv)?)
        }
        ServeRole::Broker => {
            rpcmesh_broker::main_with(&rpcmesh_broker::Args::try_parse_from(argv)?)
        }
    }
}
