//! The `/metrics` HTTP endpoint: Prometheus text exposition of one program's recorder,
//! with the program's system figures read fresh at every scrape.
//!
//! Owns the listening socket, the HTTP/1.1 serving (hyper) and its bounds: how many scrape
//! connections may be open at once, how long a client may take to send its request, how
//! long one connection may live, and the pause after a failed accept (so that running out
//! of file descriptors costs a thinned log line, not a spinning core). Leaves what is
//! rendered to [`crate::metrics::recorder`], and what is refreshed before each rendering
//! to whoever registered it ([`Telemetry::on_scrape`]).
//!
//! At the cap, a new connection takes the place of the one idle longest (no request in
//! progress: one that has sent nothing yet, or a kept-alive one between requests), which
//! is closed: idle connections cannot keep a scrape waiting behind them, however many a
//! client opens. Each close is counted by reason ([`ScrapeClose`]).
//!
//! Why the refresh: `/proc` figures (process and host CPU time) collected on a timer are
//! up to a collection interval old when scraped; a reader that takes the difference of two
//! scrapes (`driver capacity`, per step) would then measure a window shifted and stretched
//! by up to that interval. Reading them at the scrape, as node_exporter does, makes two
//! scrapes bound exactly the time between them.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::metrics::Telemetry;
use crate::net::thinned::Thinned;

/// Scrape connections open at once: a few Prometheus servers and tools need a handful;
/// beyond it a new connection takes the place of the one idle longest (and waits in the
/// listen backlog while every one is answering a request), rather than take file
/// descriptors from the program's RPC port.
pub const MAX_CONNECTIONS: usize = 16;
/// How long a client may take to send a request's headers, and how long a kept-alive
/// connection may wait idle for its next request (hyper runs the one timer for both):
/// Prometheus sends its headers at once and reconnects freely; an idle or trickling
/// connection is closed after this.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest life of one scrape connection (keep-alive included): Prometheus reconnects
/// freely, and no connection holds a slot for ever.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(120);
/// Pause after a failed accept (out of file descriptors, most often): retrying at once
/// would spin a core on the same error.
pub const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// The log budget (per process) of failed accepts.
static ACCEPT_FAILED_LINES: Thinned = Thinned::new();

/// Why a scrape connection was closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScrapeClose {
    /// Its client closed it, or asked for it to close after a response.
    Done,
    /// It was idle longest when the cap was reached, and a new connection took its place.
    Evicted,
    /// Its request's headers did not come within [`HEADER_READ_TIMEOUT`] (or it stayed
    /// idle that long between requests).
    Timeout,
    /// It reached [`CONNECTION_LIFETIME`].
    Lifetime,
    /// It failed (a bad request, a reset).
    Error,
}

impl ScrapeClose {
    /// Every reason, in the order of [`ScrapeClose::index`].
    pub const ALL: [ScrapeClose; 5] = [
        ScrapeClose::Done,
        ScrapeClose::Evicted,
        ScrapeClose::Timeout,
        ScrapeClose::Lifetime,
        ScrapeClose::Error,
    ];

    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            ScrapeClose::Done => "done",
            ScrapeClose::Evicted => "evicted",
            ScrapeClose::Timeout => "timeout",
            ScrapeClose::Lifetime => "lifetime",
            ScrapeClose::Error => "error",
        }
    }

    /// Position in [`ScrapeClose::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// The endpoint's connections closed so far, by [`ScrapeClose`] (published by the system
/// metrics as `rpcmesh_scrape_connections_closed_total`).
#[derive(Debug, Default)]
pub struct ScrapeCloses([AtomicU64; ScrapeClose::ALL.len()]);

impl ScrapeCloses {
    fn add(&self, reason: ScrapeClose) {
        self.0[reason.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Closes for `reason` so far.
    pub fn get(&self, reason: ScrapeClose) -> u64 {
        self.0[reason.index()].load(Ordering::Relaxed)
    }
}

/// The open scrape connections: since when each has been idle (`None` while it answers a
/// request), and how to close it.
#[derive(Debug, Default)]
struct Open {
    next: u64,
    conns: HashMap<u64, (Option<Instant>, CancellationToken)>,
}

/// [`Open`], shared by the accept loop and the connections' tasks.
#[derive(Debug, Default)]
struct OpenConns(Mutex<Open>);

impl OpenConns {
    fn lock(&self) -> std::sync::MutexGuard<'_, Open> {
        // Every update under the lock is a few words, done whole.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new connection, idle from now on; its id, and what closes it.
    fn add(&self) -> (u64, CancellationToken) {
        let mut o = self.lock();
        let id = o.next;
        o.next += 1;
        let close = CancellationToken::new();
        o.conns.insert(id, (Some(Instant::now()), close.clone()));
        (id, close)
    }

    /// Connection `id` began answering a request (`busy`), or is idle again.
    fn set_busy(&self, id: u64, busy: bool) {
        if let Some(c) = self.lock().conns.get_mut(&id) {
            c.0 = (!busy).then(Instant::now);
        }
    }

    fn remove(&self, id: u64) {
        self.lock().conns.remove(&id);
    }

    /// Closes the connection idle longest, if one is idle (not one already closing).
    fn close_idlest(&self) {
        let o = self.lock();
        let idlest = o
            .conns
            .values()
            .filter(|(_, close)| !close.is_cancelled())
            .filter_map(|(since, close)| since.map(|s| (s, close)))
            .min_by_key(|(since, _)| *since);
        if let Some((_, close)) = idlest {
            close.cancel();
        }
    }
}

/// The endpoint's bounds (the constants above, unless a test sets them).
#[derive(Clone, Copy, Debug)]
struct Limits {
    connections: usize,
    header_read: Duration,
    lifetime: Duration,
}

const LIMITS: Limits = Limits {
    connections: MAX_CONNECTIONS,
    header_read: HEADER_READ_TIMEOUT,
    lifetime: CONNECTION_LIFETIME,
};

/// Binds `addr` (port 0 picks one) and serves `telemetry` there from a task of the
/// current Tokio runtime until the runtime ends. Returns the bound address.
pub fn serve(telemetry: Telemetry, addr: SocketAddr) -> std::io::Result<SocketAddr> {
    serve_with(telemetry, addr, LIMITS)
}

fn serve_with(
    telemetry: Telemetry,
    addr: SocketAddr,
    limits: Limits,
) -> std::io::Result<SocketAddr> {
    let std_listener = std::net::TcpListener::bind(addr)?;
    std_listener.set_nonblocking(true)?;
    let local = std_listener.local_addr()?;
    let listener = TcpListener::from_std(std_listener)?;
    tokio::spawn(accept_loop(listener, telemetry, limits));
    Ok(local)
}

async fn accept_loop(listener: TcpListener, telemetry: Telemetry, limits: Limits) {
    let slots = Arc::new(Semaphore::new(limits.connections));
    let open = Arc::new(OpenConns::default());
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                if let Some(a) = ACCEPT_FAILED_LINES.admit() {
                    tracing::warn!(error = %e, failures = a.seen, left_out = a.left_out, "metrics endpoint: accept failed; pausing");
                }
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                continue;
            }
        };
        // At the cap, the connection idle longest makes room (its slot is free once its
        // task has ended); while every one is answering, the newcomer waits for one.
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                open.close_idlest();
                let Ok(p) = slots.clone().acquire_owned().await else {
                    return;
                };
                p
            }
        };
        let (id, close) = open.add();
        let (t, open) = (telemetry.clone(), open.clone());
        let closes = telemetry.scrape_closes().clone();
        tokio::spawn(async move {
            let service = {
                let open = open.clone();
                hyper::service::service_fn(move |req| {
                    let (t, open) = (t.clone(), open.clone());
                    async move {
                        open.set_busy(id, true);
                        let r = respond(t, req).await;
                        open.set_busy(id, false);
                        r
                    }
                })
            };
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_read)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let reason = tokio::select! {
                served = tokio::time::timeout(limits.lifetime, conn) => match served {
                    Ok(Ok(())) => ScrapeClose::Done,
                    Ok(Err(e)) if e.is_timeout() => ScrapeClose::Timeout,
                    Ok(Err(_)) => ScrapeClose::Error,
                    Err(_) => ScrapeClose::Lifetime,
                },
                () = close.cancelled() => ScrapeClose::Evicted,
            };
            closes.add(reason);
            open.remove(id);
            drop(permit);
        });
    }
}

async fn respond(
    telemetry: Telemetry,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let reply = |status: StatusCode, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"),
        );
        r
    };
    if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
        return Ok(reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "GET /metrics\n".into(),
        ));
    }
    // Refreshing reads /proc: file I/O, so on the blocking pool.
    let t = telemetry.clone();
    let text = tokio::task::spawn_blocking(move || {
        t.refresh();
        t.render()
    })
    .await
    .unwrap_or_default();
    Ok(reply(StatusCode::OK, text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    const SHORT: Limits = Limits {
        connections: 2,
        header_read: Duration::from_millis(200),
        lifetime: Duration::from_secs(30),
    };

    async fn get(s: &mut TcpStream) -> String {
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0; 65536];
        let n = s.read(&mut buf).await.unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    async fn closed(s: &mut TcpStream) -> bool {
        let mut rest = Vec::new();
        matches!(
            tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await,
            Ok(Ok(0)) | Ok(Err(_))
        )
    }

    #[tokio::test]
    async fn a_keep_alive_connection_left_idle_after_a_scrape_is_closed() {
        let addr = serve_with(Telemetry::new(), "127.0.0.1:0".parse().unwrap(), SHORT).unwrap();
        let mut s = TcpStream::connect(addr).await.unwrap();
        assert!(get(&mut s).await.starts_with("HTTP/1.1 200"));
        assert!(get(&mut s).await.starts_with("HTTP/1.1 200"), "kept alive");
        assert!(closed(&mut s).await, "the idle connection was closed");
    }

    #[tokio::test]
    async fn a_connection_over_the_cap_takes_the_place_of_the_one_idle_longest() {
        let t = Telemetry::new();
        let addr = serve_with(t.clone(), "127.0.0.1:0".parse().unwrap(), SHORT).unwrap();
        let mut idle = Vec::new();
        for _ in 0..SHORT.connections {
            idle.push(TcpStream::connect(addr).await.unwrap());
            // One after the other: each is idle from when it was accepted.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Over the cap: served at once, in the place of the oldest idle one.
        let mut late = TcpStream::connect(addr).await.unwrap();
        assert!(get(&mut late).await.starts_with("HTTP/1.1 200"));
        assert!(
            closed(&mut idle[0]).await,
            "the one idle longest was closed"
        );
        let mut b = [0; 1];
        assert!(
            matches!(idle[1].try_read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "the other idle one is still open"
        );
        assert_eq!(t.scrape_closes().get(ScrapeClose::Evicted), 1);
        assert_eq!(t.scrape_closes().get(ScrapeClose::Timeout), 0);
    }
}
