//! Reading the CPU figures of the programs on the path: a broker's or provider's from its
//! `/metrics` (process CPU time and the host's CPU time by mode, both exact fractional
//! counters read afresh at each scrape; and a broker's idle busy polling), the driver's
//! own from `/proc`. Two readings
//! bound a step: their difference over the time between them is the CPU used.
//!
//! The HTTP GET is a few lines of plain HTTP/1.0 over a Tokio stream (one request, read to
//! the end, size- and time-bounded) rather than a client crate: the endpoint is ours, the
//! request fixed, and hyper's client would add a connection pool nobody needs here.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rpcmesh_common::metrics::recorder::sample;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long one scrape may take.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest `/metrics` page read (a broker with many providers renders well under it).
const MAX_PAGE: u64 = 16 << 20;

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
    let io = |source| ProbeError::Io { addr, source };
    let page = tokio::time::timeout(SCRAPE_TIMEOUT, get(addr))
        .await
        .map_err(|_| io(std::io::ErrorKind::TimedOut.into()))?
        .map_err(io)?;
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

async fn get(addr: SocketAddr) -> std::io::Result<String> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut raw = Vec::new();
    s.take(MAX_PAGE).read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Ok(body.to_string())
}

/// The driver's own reading: its process and its host, from `/proc`.
pub fn own() -> Reading {
    let at = Instant::now();
    let process_cpu = metrics_process::collector::collect()
        .cpu_seconds_total
        .unwrap_or(0.0);
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
