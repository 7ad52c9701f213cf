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

/// Scrape connections open at once: a few Prometheus servers and tools need a handful;
/// beyond it new connections wait in the listen backlog rather than take file
/// descriptors from the program's RPC port.
pub const MAX_CONNECTIONS: usize = 16;
/// How long a client may take to send a request's headers: Prometheus sends them at
/// once; an idle or trickling connection is closed after this.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest life of one scrape connection (keep-alive included): Prometheus reconnects
/// freely, and no connection holds a slot for ever.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(120);
/// Pause after a failed accept (out of file descriptors, most often): retrying at once
/// would spin a core on the same error.
pub const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// Binds `addr` (port 0 picks one) and serves `telemetry` there from a task of the
/// current Tokio runtime until the runtime ends. Returns the bound address.
pub fn serve(telemetry: Telemetry, addr: SocketAddr) -> std::io::Result<SocketAddr> {
    let std_listener = std::net::TcpListener::bind(addr)?;
    std_listener.set_nonblocking(true)?;
    let local = std_listener.local_addr()?;
    let listener = TcpListener::from_std(std_listener)?;
    tokio::spawn(accept_loop(listener, telemetry));
    Ok(local)
}

async fn accept_loop(listener: TcpListener, telemetry: Telemetry) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut failures: u64 = 0;
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                failures += 1;
                // Thinned: the first failure, then every 100th.
                if failures % 100 == 1 {
                    tracing::warn!(error = %e, failures, "metrics endpoint: accept failed; pausing");
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
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, conn).await;
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
