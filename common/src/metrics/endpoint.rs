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
//! Why the refresh: `/proc` figures (process and host CPU time) collected on a timer are
//! up to a collection interval old when scraped; a reader that takes the difference of two
//! scrapes (`driver capacity`, per step) would then measure a window shifted and stretched
//! by up to that interval. Reading them at the scrape, as node_exporter does, makes two
//! scrapes bound exactly the time between them.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::metrics::Telemetry;
use crate::net::thinned::Thinned;

/// Scrape connections open at once: a few Prometheus servers and tools need a handful;
/// beyond it new connections wait in the listen backlog rather than take file
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
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
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
        let t = telemetry.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| respond(t.clone(), req));
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_read)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let _ = tokio::time::timeout(limits.lifetime, conn).await;
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
    async fn connections_over_the_cap_wait_until_idle_ones_are_closed() {
        let addr = serve_with(Telemetry::new(), "127.0.0.1:0".parse().unwrap(), SHORT).unwrap();
        let mut idle = Vec::new();
        for _ in 0..SHORT.connections {
            idle.push(TcpStream::connect(addr).await.unwrap());
        }
        // Over the cap: it waits in the backlog, and is served once a slot is free.
        let mut late = TcpStream::connect(addr).await.unwrap();
        assert!(get(&mut late).await.starts_with("HTTP/1.1 200"));
        for s in idle {
            let mut b = [0; 1];
            let gone = match s.try_read(&mut b) {
                Ok(n) => n == 0,
                Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
            };
            assert!(
                gone,
                "the idle connections were closed before the late one was served"
            );
        }
    }
}
