//! Reading the CPU figures of the programs on the path: a broker's or provider's from its
//! `/metrics` (process CPU time and the host's CPU time by mode, both exact fractional
//! counters read afresh at each scrape; and a broker's idle busy polling), the driver's
//! own from its process CPU clock and `/proc/stat`. Two readings bound a step: their
//! difference over the time between them is the CPU used.
//!
//! A scrape is one HTTP/1.1 GET over a connection of its own (hyper's client, without a
//! pool: two scrapes a step need none), bounded in time ([`SCRAPE_TIMEOUT`]) and size
//! ([`MAX_PAGE`]). Only a `200 OK` page is read: any other answer is an error naming the
//! status and the endpoint, never a page without CPU figures.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper::{Request, StatusCode, header};
use hyper_util::rt::TokioIo;
use rpcmesh_common::metrics::recorder::sample;

/// How long one scrape may take.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest `/metrics` page read (a broker with many providers renders well under it).
pub const MAX_PAGE: usize = 16 << 20;

/// One program's CPU figures at one moment.
#[derive(Debug, Clone, Copy)]
pub struct Reading {
    /// When it was taken.
    pub at: Instant,
    /// The process's CPU time, seconds.
    pub process_cpu: f64,
    /// The host's softirq time (all CPUs), seconds, if known.
    pub host_softirq: Option<f64>,
    /// The host's time in every mode (all CPUs), seconds, if known.
    pub host_total: Option<f64>,
    /// CPU time the program spent busy polling with nothing to read, seconds (0 for a
    /// program that does not busy-poll).
    pub idle_polling: f64,
}

impl Reading {
    /// Cores used between `self` (earlier) and `later`.
    pub fn cores(&self, later: &Reading) -> f64 {
        let secs = later.at.saturating_duration_since(self.at).as_secs_f64();
        if secs <= 0.0 {
            return 0.0;
        }
        (later.process_cpu - self.process_cpu).max(0.0) / secs
    }

    /// CPU seconds used between `self` (earlier) and `later`.
    pub fn cpu_seconds(&self, later: &Reading) -> f64 {
        (later.process_cpu - self.process_cpu).max(0.0)
    }

    /// Of those, the seconds spent busy polling with nothing to read.
    pub fn idle_polling(&self, later: &Reading) -> f64 {
        (later.idle_polling - self.idle_polling).max(0.0)
    }

    /// The host's share of CPU time in softirq between `self` and `later` (0 to 1).
    pub fn softirq_share(&self, later: &Reading) -> Option<f64> {
        let soft = later.host_softirq? - self.host_softirq?;
        let total = later.host_total? - self.host_total?;
        (total > 0.0).then(|| (soft / total).clamp(0.0, 1.0))
    }
}

/// Why a reading could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The endpoint could not be reached or answered slowly.
    #[error("scraping {addr}: {source}")]
    Io {
        /// The endpoint.
        addr: SocketAddr,
        /// What went wrong.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP exchange failed (a broken answer, a page over [`MAX_PAGE`]).
    #[error("scraping {addr}: {source}")]
    Http {
        /// The endpoint.
        addr: SocketAddr,
        /// What went wrong.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The endpoint answered, but not with a page (`404 Not Found` from something that is
    /// not a program's metrics endpoint, say).
    #[error("{addr}/metrics answered {status}")]
    Status {
        /// The endpoint.
        addr: SocketAddr,
        /// Its answer.
        status: StatusCode,
    },
    /// The page lacks the process CPU counter (not an rpcmesh program, or too old).
    #[error("{addr}/metrics has no rpcmesh_process_cpu_seconds_sum")]
    NoCpu {
        /// The endpoint.
        addr: SocketAddr,
    },
}

/// Tries of a scrape whose page lacks the CPU figures: a server prints its listening line
/// before its system metrics register, so a scrape right after start may find none yet.
const NO_CPU_TRIES: u32 = 5;
/// Pause between those tries.
const NO_CPU_PAUSE: Duration = Duration::from_millis(100);

/// Reads the `/metrics` of the program at `addr`.
pub async fn scrape(addr: SocketAddr) -> Result<Reading, ProbeError> {
    let mut tries = 0;
    loop {
        match scrape_once(addr).await {
            Err(ProbeError::NoCpu { .. }) if tries + 1 < NO_CPU_TRIES => {
                tries += 1;
                tokio::time::sleep(NO_CPU_PAUSE).await;
            }
            r => return r,
        }
    }
}

async fn scrape_once(addr: SocketAddr) -> Result<Reading, ProbeError> {
    let page = tokio::time::timeout(SCRAPE_TIMEOUT, get(addr))
        .await
        .map_err(|_| ProbeError::Io {
            addr,
            source: std::io::ErrorKind::TimedOut.into(),
        })??;
    let at = Instant::now();
    let process_cpu =
        sample(&page, "rpcmesh_process_cpu_seconds_sum", &[]).ok_or(ProbeError::NoCpu { addr })?;
    Ok(Reading {
        at,
        process_cpu,
        host_softirq: sample(
            &page,
            "rpcmesh_host_cpu_seconds_sum",
            &[("mode", "softirq")],
        ),
        host_total: sample(&page, "rpcmesh_host_cpu_seconds_sum", &[]),
        idle_polling: sample(&page, "rpcmesh_busy_poll_idle_seconds_sum", &[]).unwrap_or(0.0),
    })
}

/// `GET /metrics` from `addr`: the page, when the answer is `200 OK`.
async fn get(addr: SocketAddr) -> Result<String, ProbeError> {
    let http = |source: Box<dyn std::error::Error + Send + Sync>| ProbeError::Http { addr, source };
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|source| ProbeError::Io { addr, source })?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| http(e.into()))?;
    let request = Request::get("/metrics")
        .header(header::HOST, addr.to_string())
        .body(Empty::<Bytes>::new())
        .map_err(|e| http(e.into()))?;
    let fetch = async move {
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| http(e.into()))?;
        let status = response.status();
        if status != StatusCode::OK {
            return Err(ProbeError::Status { addr, status });
        }
        let body = Limited::new(response.into_body(), MAX_PAGE)
            .collect()
            .await
            .map_err(http)?
            .to_bytes();
        // `sender` drops with this future, and the connection closes once idle.
        Ok(String::from_utf8_lossy(&body).into_owned())
    };
    // The connection is driven beside the exchange, on this task: nothing outlives a
    // scrape. Once the page is read, how the connection ended does not matter.
    let (page, _connection) = tokio::join!(fetch, connection);
    page
}

/// The driver's own reading: its process and its host, from `/proc`.
pub fn own() -> Reading {
    let at = Instant::now();
    let process_cpu = rpcmesh_common::metrics::system::process_cpu_seconds();
    let (host_softirq, host_total) = match rpcmesh_common::metrics::system::host_cpu_seconds() {
        Some((soft, all)) => (Some(soft), Some(all)),
        None => (None, None),
    };
    Reading {
        at,
        process_cpu,
        host_softirq,
        host_total,
        idle_polling: 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server on 127.0.0.1:0 that answers up to `answers` connections, each with
    /// `status` and `body`, and then stops.
    async fn serve(status: &'static str, body: &'static str, answers: usize) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("its address");
        tokio::spawn(async move {
            for _ in 0..answers {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                let mut request = Vec::new();
                let mut buf = [0u8; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let answer = format!(
                    "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(answer.as_bytes()).await;
            }
        });
        addr
    }

    const PAGE: &str = "# TYPE rpcmesh_process_cpu_seconds_sum counter\n\
        rpcmesh_process_cpu_seconds_sum 1.5\n\
        rpcmesh_host_cpu_seconds_sum{mode=\"softirq\"} 2\n\
        rpcmesh_host_cpu_seconds_sum{mode=\"user\"} 8\n";

    #[tokio::test]
    async fn a_page_gives_the_cpu_figures() {
        let addr = serve("200 OK", PAGE, 1).await;
        let r = scrape(addr).await.expect("a reading");
        assert_eq!(r.process_cpu, 1.5);
        assert_eq!(r.host_softirq, Some(2.0));
        assert_eq!(r.host_total, Some(10.0));
    }

    /// Fails without the status check: the 404's body, read as a page, has no CPU counter
    /// and comes out as `NoCpu`, as if an rpcmesh program had answered without figures.
    #[tokio::test]
    async fn an_answer_other_than_200_is_an_error_naming_the_status_and_the_endpoint() {
        let addr = serve("404 Not Found", "no such page\n", NO_CPU_TRIES as usize).await;
        let e = scrape(addr).await.expect_err("a 404 is not a page");
        assert!(
            matches!(
                e,
                ProbeError::Status {
                    status: StatusCode::NOT_FOUND,
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            format!("{addr}/metrics answered 404 Not Found")
        );
    }
}
