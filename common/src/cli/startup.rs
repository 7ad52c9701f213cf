//! What every program's `main` does before its library's `run`: logging, the Tokio runtime,
//! and, for the servers, binding the listen address, starting the metrics endpoint and
//! waiting for SIGTERM/SIGINT ([`serve`]). A `main` is then: parse the flags, validate
//! them into the program's config, call [`serve`] (or [`start`], for the driver).
//!
//! A server always ends within its grace period once told to stop: the drain is `run`'s,
//! and should the process still be there [`EXIT_MARGIN`] after the grace period (a handler
//! burning the only runtime thread, a system call stuck in the kernel, anything the
//! runtime cannot stop), a thread of its own that saw the signal ends it
//! ([`EXIT_DEADLINE_STATUS`]). The runtime's own stop leaves behind, after
//! [`RUNTIME_STOP_WAIT`], blocking tasks that do not return.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpSocket};

use crate::cli::systemd::{self, Readiness};
use crate::cli::values::MetricsListen;
use crate::log_sink;
use crate::metrics::Telemetry;
use crate::net::shutdown::{self, ShutdownSignal};

/// How many connections may wait to be accepted on a server's listen socket. The kernel
/// caps it at `net.core.somaxconn` (4,096 by default since Linux 5.4, and what the
/// deployment's tuning role sets), so the operator's sysctl is the one knob. Tokio's own
/// `TcpListener::bind` gets 128 (mio's choice), which a fleet of drivers reconnecting at
/// once after a broker restart (or 200 connections opened together by one driver) can
/// fill: the kernel then drops SYNs and those connects wait a second or more for their
/// retransmit.
pub const LISTEN_BACKLOG: u32 = 4096;

/// How long a stopping server may take beyond its grace period before it is ended anyway:
/// the sessions' last answers ([`crate::net::listener::LAST_ANSWERS_WAIT`], 2 s), the
/// runtime's stop ([`RUNTIME_STOP_WAIT`], 1 s) and the last log lines
/// ([`log_sink::LOG_FLUSH_WAIT`], 1 s), with a second to spare. A supervisor's stop
/// timeout (systemd's `TimeoutStopSec`) should exceed the grace period plus this.
pub const EXIT_MARGIN: Duration = Duration::from_secs(5);
/// The exit status of a server ended by its deadline ([`EXIT_MARGIN`]): `EX_SOFTWARE`
/// (sysexits.h), an internal error, so that a supervisor tells it from a clean stop (0).
pub const EXIT_DEADLINE_STATUS: i32 = 70;
/// How long the runtime's stop waits for blocking tasks (file reads, `/proc`) before it
/// leaves them behind: each takes milliseconds; one that takes longer is stuck in the
/// kernel, and the process ends without it.
pub const RUNTIME_STOP_WAIT: Duration = Duration::from_secs(1);

/// Binds a server's listen socket at `addr` with [`LISTEN_BACKLOG`] (and `SO_REUSEADDR`,
/// as `TcpListener::bind` sets it, so a restarted server binds while old connections are
/// in TIME_WAIT).
pub fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// As [`bind`], before the runtime exists (a second address a `main` binds itself, such
/// as `--listen-plain`): a non-blocking std listener for `TcpListener::from_std`.
pub fn bind_std(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG as i32)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// Why a program could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    /// The Tokio runtime could not be built (threads could not be spawned).
    #[error("starting the runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The listen address could not be bound (in use, not local, not permitted).
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The metrics endpoint could not be started (its address is in use, or not local).
    #[error("starting the metrics endpoint on {addr}: {source}")]
    Metrics {
        /// The address.
        addr: SocketAddr,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
}

/// Starts logging to stderr, through the process's [`log_sink`]: a line is queued and
/// written by a thread of its own, so that logging never blocks or fails the process (a
/// stderr that is closed or takes nothing drops lines, and counts them). The filter comes
/// from `RUST_LOG` when set, else `default` (e.g. `"info"`). Log lines are plain (no
/// colours) when stderr is not a terminal.
pub fn init_logging(default: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    log_sink::install();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| log_sink::LineWriter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .try_init();
}

/// A program's Tokio runtime (it derefs to it). Dropped, it shuts the runtime down and
/// then writes out the log lines still queued, for at most [`log_sink::LOG_FLUSH_WAIT`],
/// so that a program's last lines (`broker stopped`, an error) are not lost at exit.
#[derive(Debug)]
pub struct ProgramRuntime {
    // Fields drop in order: the runtime (whose tasks may log as they end), then the flush.
    rt: StoppedInTime,
    _flush: FlushLogs,
}

impl std::ops::Deref for ProgramRuntime {
    type Target = tokio::runtime::Runtime;
    fn deref(&self) -> &tokio::runtime::Runtime {
        self.rt
            .0
            .as_ref()
            .expect("the runtime is taken only when dropped")
    }
}

/// A runtime whose stop, when dropped, waits at most [`RUNTIME_STOP_WAIT`] for its
/// blocking tasks (a plain `Runtime` waits for them for ever).
#[derive(Debug)]
struct StoppedInTime(Option<tokio::runtime::Runtime>);

impl Drop for StoppedInTime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_timeout(RUNTIME_STOP_WAIT);
        }
    }
}

/// Writes out the queued log lines when dropped (see [`ProgramRuntime`]).
#[derive(Debug)]
struct FlushLogs;

impl Drop for FlushLogs {
    fn drop(&mut self) {
        log_sink::flush(log_sink::LOG_FLUSH_WAIT);
    }
}

/// Worker threads to use when the operator says 0: one per CPU the process may run on.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The Tokio runtime with `threads` workers (0 = one per CPU). Its threads are named after
/// the program so that `top -H` shows who is busy.
///
/// One worker (`threads` 1, or 0 on a one-CPU machine) gets the current-thread scheduler,
/// not a multi-thread one with one worker: it has no work-stealing queues, no cross-thread
/// wake-ups and no clock read per batch of polled tasks (the multi-thread scheduler's
/// queue tuning). With all three programs at one thread, that gives the broker path about
/// a sixth more calls per second at 64 echo calls in flight (docs/performance.md, "What
/// each optimisation bought").
/// Tasks then run on the thread that calls `block_on` (so `thread_name` names only the
/// blocking pool's threads), and only while it is inside `block_on`; nothing may block
/// that thread, as on any worker.
pub fn build(name: &str, threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let threads = if threads == 0 {
        default_threads()
    } else {
        threads
    };
    if threads == 1 {
        return tokio::runtime::Builder::new_current_thread()
            .thread_name(name)
            .enable_all()
            .build();
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
}

/// Logging (filter `default_log` unless `RUST_LOG` says otherwise) and the runtime of
/// `program` with `threads` workers: what every `main` starts with.
pub fn start(
    program: &str,
    default_log: &str,
    threads: usize,
) -> Result<ProgramRuntime, StartupError> {
    init_logging(default_log);
    let rt = build(program, threads).map_err(StartupError::Runtime)?;
    Ok(ProgramRuntime {
        rt: StoppedInTime(Some(rt)),
        _flush: FlushLogs,
    })
}

/// Where and how a server program runs: what [`serve`] and [`serve_with`] take beside its
/// `run`.
#[derive(Debug, Clone, Copy)]
pub struct Server<'a> {
    /// The program's name (`broker`, `provider`): its threads' and log lines'.
    pub program: &'a str,
    /// The address to take calls on.
    pub listen: SocketAddr,
    /// The metrics endpoint's address, or none.
    pub metrics: MetricsListen,
    /// Runtime worker threads (0 = one per CPU).
    pub threads: usize,
    /// How long the drain may take once told to stop: the process ends at most
    /// [`EXIT_MARGIN`] after it.
    pub grace: Duration,
}

/// The whole life of a server program after its flags are validated: logging at `info`,
/// the runtime, the listener on `listen`, the metrics endpoint on `metrics` (or none), one
/// line on stdout saying where both are (see [`listening_line`]), then
/// `run(telemetry, listener, shutdown)` until it returns (it drains on SIGTERM/SIGINT;
/// the process ends at most [`EXIT_MARGIN`] after the grace period whatever it does).
/// Under systemd it is ready once it listens ([`serve_with`] for another moment).
pub fn serve<F, Fut>(server: Server<'_>, run: F) -> Result<(), StartupError>
where
    F: FnOnce(Telemetry, TcpListener, ShutdownSignal) -> Fut,
    Fut: Future,
{
    serve_with(server, Readiness::WhenListening, run)
}

/// Ends the process [`EXIT_MARGIN`] after the grace period `grace` once SIGTERM or SIGINT
/// comes, unless it has ended by then: a thread of its own waits for the signal, so that
/// nothing the runtime is stuck on (a handler burning its only thread, a blocked system
/// call) can hold the process past it. The signal is also the runtime's (both register
/// through `signal-hook-registry`, which runs every handler of a signal).
fn end_by_deadline(program: &str, grace: Duration) {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let deadline = grace.saturating_add(EXIT_MARGIN);
    let mut signals = match signal_hook::iterator::Signals::new([SIGTERM, SIGINT]) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "no exit deadline: SIGTERM cannot be watched beside the runtime");
            return;
        }
    };
    let spawned = std::thread::Builder::new()
        .name(format!("{program}-deadline"))
        .spawn(move || {
            if signals.forever().next().is_some() {
                std::thread::sleep(deadline);
                tracing::error!(
                    deadline_ms = deadline.as_millis() as u64,
                    status = EXIT_DEADLINE_STATUS,
                    "still running past the grace period and the margin after SIGTERM: exiting"
                );
                log_sink::flush(log_sink::LOG_FLUSH_WAIT);
                std::process::exit(EXIT_DEADLINE_STATUS);
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no exit deadline: its thread could not start");
    }
}

/// As [`serve`], telling systemd (when it runs the program: [`systemd`]) `READY=1` at the
/// moment `readiness` says, `STOPPING=1` when the shutdown signal comes, and pinging its
/// watchdog from the runtime when the unit has one.
pub fn serve_with<F, Fut>(
    server: Server<'_>,
    readiness: Readiness,
    run: F,
) -> Result<(), StartupError>
where
    F: FnOnce(Telemetry, TcpListener, ShutdownSignal) -> Fut,
    Fut: Future,
{
    let Server {
        program,
        listen,
        metrics,
        threads,
        grace,
    } = server;
    let rt = start(program, "info", threads)?;
    end_by_deadline(program, grace);
    rt.block_on(async {
        let listener = bind(listen).map_err(|source| StartupError::Bind {
            addr: listen,
            source,
        })?;
        let telemetry =
            crate::metrics::recorder::start(metrics.0).map_err(|source| StartupError::Metrics {
                addr: metrics.0.unwrap_or(listen),
                source,
            })?;
        let rpc = listener.local_addr().unwrap_or(listen);
        let line = listening_line(program, rpc, telemetry.served_at());
        {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{line}");
            let _ = out.flush();
        }
        let watchdog = systemd::spawn_watchdog();
        if readiness == Readiness::WhenListening {
            systemd::notify_ready(&line);
        }
        let shutdown = async {
            shutdown::signal().await;
            systemd::notify_stopping();
        };
        run(telemetry, listener, Box::pin(shutdown)).await;
        if let Some(w) = watchdog {
            w.abort();
        }
        Ok(())
    })
}

/// The line a server prints on stdout once it listens, so that a script or a parent
/// process that asked for port 0 learns the ports:
/// `rpcmesh provider listening rpc=127.0.0.1:41234 metrics=127.0.0.1:41235` (`metrics=off`
/// without an endpoint). Parsed back by [`parse_listening_line`].
pub fn listening_line(program: &str, rpc: SocketAddr, metrics: Option<SocketAddr>) -> String {
    match metrics {
        Some(m) => format!("rpcmesh {program} listening rpc={rpc} metrics={m}"),
        None => format!("rpcmesh {program} listening rpc={rpc} metrics=off"),
    }
}

/// The addresses of a [`listening_line`]: `(rpc, metrics)`.
pub fn parse_listening_line(line: &str) -> Option<(SocketAddr, Option<SocketAddr>)> {
    let rest = line.trim().strip_prefix("rpcmesh ")?;
    let (_, rest) = rest.split_once(" listening ")?;
    let mut rpc = None;
    let mut metrics = None;
    for part in rest.split_whitespace() {
        match part.split_once('=') {
            Some(("rpc", a)) => rpc = a.parse().ok(),
            Some(("metrics", "off")) => metrics = Some(None),
            Some(("metrics", a)) => metrics = Some(Some(a.parse().ok()?)),
            _ => {}
        }
    }
    Some((rpc?, metrics?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listening_line_parses_back() {
        let rpc: SocketAddr = "127.0.0.1:7700".parse().unwrap();
        let m: SocketAddr = "[::1]:9770".parse().unwrap();
        for metrics in [Some(m), None] {
            let line = listening_line("broker", rpc, metrics);
            assert_eq!(parse_listening_line(&line), Some((rpc, metrics)), "{line}");
        }
        assert_eq!(parse_listening_line("something else"), None);
    }

    /// The backlog the kernel holds for the socket listening on `addr` (an IPv4 one): the
    /// longest accept queue it allows, which the kernel's socket table (sock_diag, what
    /// `ss` reads) reports as the send queue of a socket in LISTEN.
    fn listen_backlog(addr: SocketAddr) -> u32 {
        use netlink_packet_core::{
            NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
        };
        use netlink_packet_sock_diag::SockDiagMessage;
        use netlink_packet_sock_diag::constants::{AF_INET, IPPROTO_TCP};
        use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
        use netlink_sys::protocols::NETLINK_SOCK_DIAG;

        let mut socket = netlink_sys::Socket::new(NETLINK_SOCK_DIAG).expect("a sock_diag socket");
        socket.bind_auto().expect("bind the netlink socket");
        socket
            .connect(&netlink_sys::SocketAddr::new(0, 0))
            .expect("connect to the kernel");
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        let request = SockDiagMessage::InetRequest(InetRequest {
            family: AF_INET,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::LISTEN,
            socket_id: SocketId::new_v4(),
        });
        let mut packet = NetlinkMessage::new(header, request.into());
        packet.finalize();
        let mut out = vec![0; packet.buffer_len()];
        packet.serialize(&mut out);
        socket.send(&out, 0).expect("send the dump request");
        let mut answer = vec![0; 1 << 16];
        loop {
            let n = socket.recv(&mut &mut answer[..], 0).expect("read the dump");
            let mut at = 0;
            while at < n {
                let message = NetlinkMessage::<SockDiagMessage>::deserialize(&answer[at..n])
                    .expect("a sock_diag message");
                match message.payload {
                    NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r))
                        if r.header.socket_id.source_port == addr.port()
                            && r.header.socket_id.source_address == addr.ip() =>
                    {
                        return r.header.send_queue;
                    }
                    NetlinkPayload::Done(_) => panic!("{addr} is not in the kernel's table"),
                    NetlinkPayload::Error(e) => panic!("sock_diag: {e:?}"),
                    _ => {}
                }
                let length = message.header.length as usize;
                assert!(length > 0, "an empty netlink message");
                at += length;
            }
        }
    }

    #[test]
    fn servers_listen_with_the_backlog_the_kernel_allows() {
        let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let rt = build("test", 1).unwrap();
        rt.block_on(async {
            let ours = bind("127.0.0.1:0".parse().unwrap()).unwrap();
            let tokio_default = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let got = listen_backlog(ours.local_addr().unwrap());
            assert_eq!(got, LISTEN_BACKLOG.min(somaxconn));
            // The control: Tokio's own bind (mio asks for 128) shows less on this machine,
            // so the figure above is the setting and not a constant of the machine.
            let default = listen_backlog(tokio_default.local_addr().unwrap());
            assert!(default < got, "tokio's bind: {default}, ours: {got}");
            // It is the socket the servers get, and it accepts.
            let addr = ours.local_addr().unwrap();
            let (accepted, connected) =
                tokio::join!(ours.accept(), tokio::net::TcpStream::connect(addr));
            accepted.unwrap();
            connected.unwrap();
        });
    }

    fn test_server(listen: SocketAddr) -> Server<'static> {
        Server {
            program: "test",
            listen,
            metrics: MetricsListen(None),
            threads: 1,
            grace: Duration::from_secs(1),
        }
    }

    #[test]
    fn a_server_that_cannot_bind_says_which_address() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let e = serve(test_server(addr), |_, _, _| async {}).expect_err("the address is taken");
        assert!(
            matches!(e, StartupError::Bind { addr: a, .. } if a == addr),
            "{e}"
        );
        assert!(e.to_string().contains(&addr.to_string()), "{e}");
    }

    #[test]
    fn a_server_runs_its_library_with_the_bound_listener() {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
        let s = seen.clone();
        serve(
            test_server("127.0.0.1:0".parse().unwrap()),
            move |telemetry, listener, _shutdown| async move {
                *s.lock().unwrap() =
                    Some((telemetry.is_recording(), listener.local_addr().is_ok()));
            },
        )
        .unwrap();
        assert_eq!(*seen.lock().unwrap(), Some((false, true)));
    }
}
