//! The reference implementation's golden frames (`common/wire/tests/data/vectors.txt`),
//! by name, and one exchange of a golden request for as many bytes as its golden reply.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::bad_input::PROBE_TIMEOUT;

/// A golden frame of the reference implementation, by its name in
/// `common/wire/tests/data/vectors.txt`.
pub fn golden(name: &str) -> Vec<u8> {
    let text = include_str!("../../common/wire/tests/data/vectors.txt");
    let hex = text
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no golden frame named {name}"));
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect()
}

/// Sends a golden request on a fresh connection and returns as many bytes as the golden
/// reply has (or fails after [`PROBE_TIMEOUT`]).
pub async fn golden_exchange(
    addr: std::net::SocketAddr,
    request: &str,
    reply: &str,
) -> std::io::Result<(Vec<u8>, Vec<u8>)> {
    let (req, want) = (golden(request), golden(reply));
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(&req).await?;
    let mut got = vec![0u8; want.len()];
    tokio::time::timeout(PROBE_TIMEOUT, s.read_exact(&mut got))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    Ok((got, want))
}
