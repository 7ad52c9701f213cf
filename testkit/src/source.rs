//! Connections from a chosen source address on loopback: Linux routes all of 127.0.0.0/8
//! to `lo`, so a test binds 127.0.0.2, 127.0.0.3… to play several client hosts on one
//! machine, as the servers' limits per source see them.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::time::Duration;

/// The `n`-th loopback source a test plays (`n` from 1: 127.0.0.1 is the test's own,
/// so 1 is 127.0.0.2), for up to 65,534 sources.
pub fn loopback_source(n: u16) -> Ipv4Addr {
    let [hi, lo] = (n + 1).to_be_bytes();
    Ipv4Addr::new(127, 0, hi, lo)
}

/// A connection to `to` from `source` (port chosen by the kernel; `SO_REUSEADDR`, so that
/// ports left in TIME_WAIT by earlier connections of the same test can be taken again),
/// within `timeout`.
pub fn connect_from(
    source: Ipv4Addr,
    to: SocketAddr,
    timeout: Duration,
) -> std::io::Result<TcpStream> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.bind(&SocketAddr::V4(SocketAddrV4::new(source, 0)).into())?;
    s.connect_timeout(&to.into(), timeout)?;
    Ok(s.into())
}
