//! The accept loop shared by the provider and the broker: a cap on open connections, caps
//! per source (connections open, and how fast it opens them: [`crate::net::sources`]), a
//! back-off when the process runs out of file descriptors, one task per connection, and
//! draining on shutdown. Its log lines (refusals, failed accepts) are thinned per process.
//!
//! Owns connection admission and the connection tasks' lifetimes; what a connection does
//! is the session's, given as a closure (servers run [`crate::net::session::serve`]),
//! which is told which of the server's [`Listeners`] it came through ([`Via`]): a server
//! with TLS takes TLS on its main address and, beside it, plain RPCF v1 on a second one
//! for the v1 peers that speak nothing else. Both share the cap and the drain.
//!
//! Shutdown: the listener is dropped at once (new connections are refused by the kernel),
//! each connection's token is cancelled so its session stops taking new calls and finishes
//! the ones in flight, and the loop waits for them up to the grace period. Then the
//! sessions still running are told the grace period is over, answer their calls still in
//! flight "shutting down" and close; what is left after [`LAST_ANSWERS_WAIT`] is aborted.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::net::{TcpListener, TcpStream};

use crate::net::connection::CloseReason;
use crate::net::session::Stop;
use crate::net::sources::{OverLimit, Source, SourceLimits, Sources};
use crate::net::thinned::Thinned;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// First pause after an accept error such as "too many open files"; doubled each time
/// up to [`ACCEPT_BACKOFF_MAX`], so a process out of descriptors does not spin.
pub const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);
/// Longest pause between accept attempts after errors.
pub const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Connections the loop accepts (or refuses) in a row before it yields until the runtime
/// has polled its sockets: accepting is one task among the sessions, and a flood of
/// connects gets about the share of one busy session, not the whole thread. Each accept
/// costs tens of µs (the `accept`, and a session's spawn or a refusal's `close`, which on
/// loopback also delivers the reset to the peer); while the loop is not accepting, new
/// connections wait in the listen backlog, and once it is full the kernel makes their
/// senders wait for a retransmit, which is where a flood's cost belongs. Two amortise the
/// yield (one `epoll_wait`) over the accepts of a burst of well-behaved clients; more let
/// a client that connects as fast as it can take most of the thread (measured with 8 and
/// 32 in `system-tests/tests/bounds.rs`: the other clients kept about a third of their
/// throughput, against 0.7 with 2).
pub const ACCEPT_BATCH: usize = 2;
/// How long the loop waits after a batch of [`ACCEPT_BATCH`] connections it all refused (at
/// the cap, or over their sources' limits) before it accepts again: a flood of connects
/// the limits refuse then costs the process at most about 2,000 accepts and closes a
/// second, while it waits in the listen backlog, whose overflow the kernel answers by
/// dropping SYNs (the flood's connects then wait for their retransmit). The price: while a
/// flood goes on, new connections from other clients wait behind it in the backlog; the
/// connections already open are served as before.
pub const REFUSED_BATCH_PAUSE: Duration = Duration::from_millis(1);

/// How long sessions have, once the grace period is over, to answer their last calls and
/// close: a final flush (1 s) and the broker's upstream connections' answers, with room to
/// spare. A supervisor's stop timeout should exceed the grace period plus this.
pub const LAST_ANSWERS_WAIT: Duration = Duration::from_secs(2);

/// Log budgets (per process) of refused connections, one per reason, and of failed
/// accepts.
static REFUSED_LINES: [Thinned; Refusal::ALL.len()] =
    [const { Thinned::new() }; Refusal::ALL.len()];
static ACCEPT_FAILED_LINES: Thinned = Thinned::new();

/// Limits of the accept loop.
#[derive(Clone, Copy, Debug)]
pub struct AcceptConfig {
    /// Connections open at once; one more is accepted and closed at once.
    pub max_connections: usize,
    /// The limits on each source; over them, a connection is accepted and closed at once.
    pub sources: SourceLimits,
    /// How long shutdown waits for sessions to finish their calls.
    pub grace: Duration,
}

/// Why a connection was accepted and closed at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The connection cap was reached.
    ConnectionCap,
    /// Its source has its share of connections open (`--max-connections-per-source`).
    SourceConnections,
    /// Its source opens connections faster than its rate (`--accept-rate-per-source`).
    SourceRate,
}

impl Refusal {
    /// Every reason, in the order of [`Refusal::index`].
    pub const ALL: [Refusal; 3] = [
        Refusal::ConnectionCap,
        Refusal::SourceConnections,
        Refusal::SourceRate,
    ];

    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::ConnectionCap => "connection_cap",
            Refusal::SourceConnections => "source_connections",
            Refusal::SourceRate => "source_rate",
        }
    }

    /// Position in [`Refusal::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Logs a connection from `peer` refused for this reason, thinned (one budget per
    /// reason and process, whichever loop accepts): at the cap, `max_connections`; over
    /// its source's limits, what the source has open (`open`) and the `limits`.
    pub fn log(self, peer: SocketAddr, max_connections: usize, open: usize, limits: SourceLimits) {
        let Some(a) = REFUSED_LINES[self.index()].admit() else {
            return;
        };
        match self {
            Refusal::ConnectionCap => {
                tracing::warn!(%peer, max = max_connections, refused = a.seen, left_out = a.left_out, "connection refused: too many open connections");
            }
            Refusal::SourceConnections | Refusal::SourceRate => {
                tracing::warn!(%peer, source = %Source::of(peer.ip()).ip(), reason = self.label(), open, max_per_source = limits.max_connections, rate = limits.rate.map(|r| r.per_second), burst = limits.rate.map(|r| r.burst), refused = a.seen, left_out = a.left_out, "connection refused: over its source's limits");
            }
        }
    }
}

impl From<OverLimit> for Refusal {
    fn from(o: OverLimit) -> Refusal {
        match o {
            OverLimit::Connections => Refusal::SourceConnections,
            OverLimit::Rate => Refusal::SourceRate,
        }
    }
}

/// What happened over the listener's life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServeSummary {
    /// Connections accepted and served.
    pub accepted: u64,
    /// Connections closed at once: the cap was reached, or their source's limits.
    pub refused: u64,
    /// Sessions still running when the grace period ended (their calls still in flight
    /// were answered "shutting down").
    pub cut: usize,
    /// Sessions still running [`LAST_ANSWERS_WAIT`] after that (aborted).
    pub aborted: usize,
}

/// The sockets a server accepts on.
#[derive(Debug)]
pub struct Listeners {
    /// The main address (`--listen`): TLS when the server has it, else plain.
    pub main: TcpListener,
    /// A plain address beside a TLS one (`--listen-plain`).
    pub plain: Option<TcpListener>,
}

impl Listeners {
    /// The main listener with the plain one bound at start-up (`--listen-plain`), taken
    /// onto the runtime; a plain listener the runtime cannot take is logged and left out
    /// (the main address still serves).
    pub fn with_plain(main: TcpListener, plain: Option<std::net::TcpListener>) -> Listeners {
        let plain = plain.and_then(|l| {
            TcpListener::from_std(l)
                .inspect_err(|e| tracing::error!(error = %e, "the plain address cannot be served"))
                .ok()
        });
        if let Some(p) = &plain {
            tracing::info!(addr = ?p.local_addr().ok(), "plain RPCF v1 beside TLS");
        }
        Listeners { main, plain }
    }
}

impl From<TcpListener> for Listeners {
    fn from(main: TcpListener) -> Self {
        Listeners { main, plain: None }
    }
}

/// Which listener a connection came through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// The main address.
    Main,
    /// The plain address beside a TLS one.
    Plain,
}

/// Hooks the accept loop calls, for metrics and logs.
pub trait AcceptObserver: Send + Sync + 'static {
    /// A connection was accepted (and will be served).
    fn opened(&self) {}
    /// A served connection ended, for `reason`.
    fn closed(&self, _reason: CloseReason) {}
    /// A connection was accepted and closed at once, for `reason`.
    fn refused(&self, _reason: Refusal) {}
}

/// An observer that does nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoObserver;
impl AcceptObserver for NoObserver {}

/// Accepts connections until `shutdown` is cancelled, running `session(stream, peer,
/// via, stop)` for each in its own task; the session says why it ended. Returns after the
/// drain; `grace_over` is cancelled when the grace period ends (the caller may give it to
/// other tasks that hold calls, as the broker does to its upstream connections).
pub async fn serve<F, Fut>(
    listeners: impl Into<Listeners>,
    config: AcceptConfig,
    shutdown: CancellationToken,
    grace_over: CancellationToken,
    observer: Arc<dyn AcceptObserver>,
    mut session: F,
) -> ServeSummary
where
    F: FnMut(TcpStream, SocketAddr, Via, Stop) -> Fut,
    Fut: Future<Output = CloseReason> + Send + 'static,
{
    let mut summary = ServeSummary::default();
    let mut tasks = JoinSet::new();
    let open = Arc::new(AtomicUsize::new(0));
    // The source of each session's task, so that its count goes down when the task ends
    // (however it ends: the join says which task, even one that panicked).
    let mut sources = Sources::new(config.sources, config.max_connections);
    let mut source_of: HashMap<tokio::task::Id, Source> = HashMap::new();
    let mut backoff = ACCEPT_BACKOFF_MIN;
    let (mut in_a_row, mut refused_in_batch) = (0, 0);
    let Listeners { main, plain } = listeners.into();
    let local = main.local_addr().ok();
    let (main, plain) = match (Acceptor::new(main), plain.map(Acceptor::new).transpose()) {
        (Ok(m), Ok(p)) => (m, p),
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!(error = %e, "the listener cannot be served");
            return summary;
        }
    };
    let accept = |cx: &mut std::task::Context<'_>| {
        if let std::task::Poll::Ready(r) = main.poll_accept(cx) {
            return std::task::Poll::Ready((Via::Main, r));
        }
        match &plain {
            Some(p) => p.poll_accept(cx).map(|r| (Via::Plain, r)),
            None => std::task::Poll::Pending,
        }
    };
    loop {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            Some(joined) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                let id = match joined {
                    Ok((id, ())) => id,
                    Err(e) => e.id(),
                };
                if let Some(source) = source_of.remove(&id) {
                    sources.closed(source);
                }
            }
            (via, accepted) = std::future::poll_fn(accept) => match accepted {
                Ok((stream, peer)) => {
                    backoff = ACCEPT_BACKOFF_MIN;
                    in_a_row += 1;
                    if in_a_row > ACCEPT_BATCH {
                        let all_refused = refused_in_batch == ACCEPT_BATCH;
                        (in_a_row, refused_in_batch) = (1, 0);
                        if all_refused {
                            tokio::time::sleep(REFUSED_BATCH_PAUSE).await;
                        } else {
                            // Woken once the runtime has polled its sockets.
                            tokio::task::yield_now().await;
                        }
                    }
                    if open.load(Ordering::Relaxed) >= config.max_connections {
                        refused_in_batch += 1;
                        summary.refused += 1;
                        observer.refused(Refusal::ConnectionCap);
                        Refusal::ConnectionCap.log(peer, config.max_connections, 0, config.sources);
                        drop(stream);
                        continue;
                    }
                    let source = Source::of(peer.ip());
                    if let Err(over) = sources.admit(source, tokio::time::Instant::now()) {
                        let reason = Refusal::from(over);
                        refused_in_batch += 1;
                        summary.refused += 1;
                        observer.refused(reason);
                        reason.log(peer, config.max_connections, sources.open(source), config.sources);
                        drop(stream);
                        continue;
                    }
                    let stream = match into_tokio(stream) {
                        Ok(s) => s,
                        Err(e) => {
                            sources.closed(source);
                            tracing::debug!(%peer, error = %e, "accepted connection not served");
                            continue;
                        }
                    };
                    summary.accepted += 1;
                    open.fetch_add(1, Ordering::Relaxed);
                    observer.opened();
                    tracing::debug!(%peer, "connection accepted");
                    let stop = Stop {
                        drain: shutdown.child_token(),
                        grace_over: grace_over.clone(),
                    };
                    let fut = session(stream, peer, via, stop);
                    let open = open.clone();
                    let observer = observer.clone();
                    let task = tasks.spawn(async move {
                        let reason = fut.await;
                        open.fetch_sub(1, Ordering::Relaxed);
                        observer.closed(reason);
                    });
                    source_of.insert(task.id(), source);
                }
                Err(e) if is_transient(&e) => {
                    tracing::debug!(error = %e, "accept failed; continuing");
                }
                Err(e) => {
                    if let Some(a) = ACCEPT_FAILED_LINES.admit() {
                        tracing::warn!(error = %e, pause_ms = backoff.as_millis() as u64, failures = a.seen, left_out = a.left_out, "accept failed; pausing");
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                }
            },
        }
    }
    drop(main);
    drop(plain);
    tracing::info!(
        addr = local.map(tracing::field::display),
        sessions = tasks.len(),
        grace_ms = config.grace.as_millis() as u64,
        "listener closed; draining"
    );
    let drained = tokio::time::timeout(config.grace, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        summary.cut = tasks.len();
        tracing::warn!(
            sessions = tasks.len(),
            "grace period over; answering the calls still in flight \"shutting down\""
        );
        grace_over.cancel();
        let closed = tokio::time::timeout(LAST_ANSWERS_WAIT, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        if closed.is_err() {
            summary.aborted = tasks.len();
            tracing::warn!(sessions = tasks.len(), "aborting sessions");
            tasks.shutdown().await;
        }
    }
    summary
}

/// A listening socket accepted from without registering each connection with the
/// runtime first: a connection refused (at the cap, or over its source's limits) costs an
/// `accept` and a `close`, and only one that is served is registered ([`into_tokio`]).
/// Tokio's own `TcpListener::accept` registers every connection it returns, which for a
/// refusal doubles the system calls (added to epoll, then taken out).
struct Acceptor(AsyncFd<std::net::TcpListener>);

impl Acceptor {
    fn new(l: TcpListener) -> io::Result<Acceptor> {
        let l = l.into_std()?;
        // `AsyncFd::with_interest` is deprecated because any `AsRawFd` can be passed, one
        // whose descriptor changes or closes while registered; the listener is owned here
        // for its whole registration, which is the sound use (as `net::timer`'s timerfd).
        #[allow(deprecated)]
        AsyncFd::with_interest(l, Interest::READABLE).map(Acceptor)
    }

    fn poll_accept(
        &self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<(std::net::TcpStream, SocketAddr)>> {
        loop {
            let mut ready = std::task::ready!(self.0.poll_read_ready(cx))?;
            if let Ok(r) = ready.try_io(|l| l.get_ref().accept()) {
                return std::task::Poll::Ready(r);
            }
        }
    }
}

/// A connection to serve, registered with the runtime.
fn into_tokio(s: std::net::TcpStream) -> io::Result<TcpStream> {
    s.set_nonblocking(true)?;
    TcpStream::from_std(s)
}

/// Errors that concern one incoming connection only (it went away before we took it).
fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
    )
}
