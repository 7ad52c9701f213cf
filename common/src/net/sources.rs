//! Admission per source for the accept loop: how many connections each source has open,
//! and a token bucket per source for how fast it may open new ones. A source is the
//! peer's IP address; an IPv6 peer is known by its /64, the block a single host is
//! routinely given (per address, one host could take 2^64 sources).
//!
//! Owns the table of sources and its bound; what is done with a refusal (the connection
//! accepted and closed at once, counted, logged thinned) is the listener's. Without it,
//! one client could hold the whole connection cap with idle sockets, or open thousands of
//! connections a second that each cost a session, so that the others' calls waited behind
//! its newcomers in the run queue.

use std::collections::HashMap;
use std::net::IpAddr;

use tokio::time::Instant;

/// Connections one source may have open at once (`--max-connections-per-source`). A
/// client host needs a handful (a driver multiplexes its users over `--connections`, 8 by
/// default; a broker holds `--pool-size`, 4, per provider); 1,024 leaves room for many
/// clients behind one address (a NAT), while one source can take at most a quarter of the
/// provider's cap (4,096) and about a tenth of the broker's (10,000): it cannot hold the
/// whole cap alone.
pub const DEFAULT_MAX_CONNECTIONS_PER_SOURCE: usize = 1024;
/// New connections a second one source may open, sustained (`--accept-rate-per-source`):
/// rpcmesh's clients keep their connections and multiplex calls over them (a driver's
/// reconnects back off to one a second per worker and target), so tens a second is far
/// beyond a well-behaved host's need once its burst is spent, while a source that
/// connects, sends a call and leaves as fast as it can costs at most this many sessions a
/// second (each about as much as tens of calls on a kept connection); the rest of its
/// attempts cost an `accept` and a `close` each. A client that connects once per call at
/// more than this (a script) is refused and should keep its connection.
pub const DEFAULT_ACCEPT_RATE_PER_SOURCE: u32 = 64;
/// New connections one source may open at once before the rate holds it
/// (`--accept-burst-per-source`): its whole share of [`DEFAULT_MAX_CONNECTIONS_PER_SOURCE`],
/// so that a driver opening hundreds of connections together, or clients reconnecting
/// together after a restart, are not refused.
pub const DEFAULT_ACCEPT_BURST_PER_SOURCE: u32 = 1024;

/// Sources the table keeps without an open connection, beyond the connection cap, before
/// it forgets those whose buckets have refilled: a sweep then costs one pass for as many
/// new sources as the cap, and the table stays within about twice the cap.
const SPARE_SOURCES: usize = 1024;

/// How fast one source may open connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AcceptRate {
    /// Tokens added a second.
    pub per_second: u32,
    /// The bucket's size: connections a source may open at once.
    pub burst: u32,
}

/// The limits on each source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourceLimits {
    /// Connections one source may have open at once.
    pub max_connections: usize,
    /// How fast one source may open connections (`None`: as fast as it likes).
    pub rate: Option<AcceptRate>,
}

impl Default for SourceLimits {
    fn default() -> Self {
        SourceLimits {
            max_connections: DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
            rate: Some(AcceptRate {
                per_second: DEFAULT_ACCEPT_RATE_PER_SOURCE,
                burst: DEFAULT_ACCEPT_BURST_PER_SOURCE,
            }),
        }
    }
}

impl SourceLimits {
    /// No limit per source (a test's, or a server behind a proxy that hides its clients).
    pub const NONE: SourceLimits = SourceLimits {
        max_connections: usize::MAX,
        rate: None,
    };
}

/// Where a connection comes from, as the limits count it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Source(IpAddr);

impl Source {
    /// The source of a peer at `ip`: the address itself for IPv4 (an IPv4-mapped IPv6
    /// address is the IPv4 one), its /64 for IPv6.
    pub fn of(ip: IpAddr) -> Source {
        match ip {
            IpAddr::V4(v4) => Source(IpAddr::V4(v4)),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Source(IpAddr::V4(v4)),
                None => Source(IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into())),
            },
        }
    }

    /// The address it is known by.
    pub fn ip(self) -> IpAddr {
        self.0
    }
}

/// Why a source may not open one more connection now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverLimit {
    /// It has [`SourceLimits::max_connections`] open.
    Connections,
    /// Its bucket is empty: it opened connections faster than its rate.
    Rate,
}

/// One source's state.
#[derive(Debug)]
struct Entry {
    open: usize,
    tokens: f64,
    at: Instant,
}

impl Entry {
    /// The bucket refilled up to `now`.
    fn refill(&mut self, rate: Option<AcceptRate>, now: Instant) {
        if let Some(r) = rate {
            let dt = now.saturating_duration_since(self.at).as_secs_f64();
            self.tokens = (self.tokens + dt * f64::from(r.per_second)).min(f64::from(r.burst));
        }
        self.at = now;
    }

    /// True when the source has nothing open and a full bucket: forgetting it changes
    /// nothing.
    fn is_idle(&self, rate: Option<AcceptRate>) -> bool {
        self.open == 0 && rate.is_none_or(|r| self.tokens >= f64::from(r.burst))
    }
}

/// The sources with connections open or with buckets not yet refilled, for one listener.
#[derive(Debug)]
pub struct Sources {
    limits: SourceLimits,
    table: HashMap<Source, Entry>,
    /// Entries the table may hold before a sweep.
    sweep_at: usize,
}

impl Sources {
    /// An empty table for a listener whose connection cap is `cap`.
    pub fn new(limits: SourceLimits, cap: usize) -> Sources {
        Sources {
            limits,
            table: HashMap::new(),
            sweep_at: cap.saturating_add(SPARE_SOURCES),
        }
    }

    /// Admits one more connection from `source` at `now`, or says which limit it is over.
    pub fn admit(&mut self, source: Source, now: Instant) -> Result<(), OverLimit> {
        if self.limits.max_connections == usize::MAX && self.limits.rate.is_none() {
            return Ok(());
        }
        if self.table.len() >= self.sweep_at && !self.table.contains_key(&source) {
            self.sweep(now);
        }
        let rate = self.limits.rate;
        let e = self.table.entry(source).or_insert_with(|| Entry {
            open: 0,
            tokens: rate.map_or(0.0, |r| f64::from(r.burst)),
            at: now,
        });
        e.refill(rate, now);
        if e.open >= self.limits.max_connections {
            return Err(OverLimit::Connections);
        }
        if rate.is_some() {
            if e.tokens < 1.0 {
                return Err(OverLimit::Rate);
            }
            e.tokens -= 1.0;
        }
        e.open += 1;
        Ok(())
    }

    /// A connection `source` opened (admitted) has closed.
    pub fn closed(&mut self, source: Source) {
        let rate = self.limits.rate;
        if let Some(e) = self.table.get_mut(&source) {
            e.open = e.open.saturating_sub(1);
            if e.is_idle(rate) {
                self.table.remove(&source);
            }
        }
    }

    /// Connections `source` has open now.
    pub fn open(&self, source: Source) -> usize {
        self.table.get(&source).map_or(0, |e| e.open)
    }

    /// Sources in the table.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// True when no source is in the table.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Forgets the sources that changed nothing by being kept (nothing open, bucket
    /// refilled); if the table is still full, those with nothing open at all (their
    /// rate starts afresh: a source can hold an entry only with a connection open, and
    /// the connection cap bounds those).
    fn sweep(&mut self, now: Instant) {
        let rate = self.limits.rate;
        self.table.retain(|_, e| {
            e.refill(rate, now);
            !e.is_idle(rate)
        });
        if self.table.len() >= self.sweep_at {
            self.table.retain(|_, e| e.open > 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};
    use std::time::Duration;

    fn v4(last: u8) -> Source {
        Source::of(IpAddr::V4(Ipv4Addr::new(127, 0, 0, last)))
    }

    #[test]
    fn an_ipv6_host_is_its_64_and_a_mapped_ipv4_address_is_the_ipv4_one() {
        let a: Ipv6Addr = "2001:db8:1:2::1".parse().unwrap();
        let b: Ipv6Addr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let c: Ipv6Addr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(Source::of(a.into()), Source::of(b.into()));
        assert_ne!(Source::of(a.into()), Source::of(c.into()));
        let mapped = Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped();
        assert_eq!(
            Source::of(mapped.into()),
            Source::of(Ipv4Addr::new(10, 0, 0, 1).into())
        );
    }

    #[test]
    fn a_source_may_hold_its_share_and_no_more_while_others_get_in() {
        let limits = SourceLimits {
            max_connections: 3,
            rate: None,
        };
        let mut s = Sources::new(limits, 100);
        let now = Instant::now();
        for _ in 0..3 {
            assert_eq!(s.admit(v4(1), now), Ok(()));
        }
        assert_eq!(s.admit(v4(1), now), Err(OverLimit::Connections));
        assert_eq!(s.admit(v4(2), now), Ok(()), "another source gets in");
        s.closed(v4(1));
        assert_eq!(s.admit(v4(1), now), Ok(()), "room once one closed");
        for _ in 0..3 {
            s.closed(v4(1));
        }
        s.closed(v4(2));
        assert!(s.is_empty(), "sources with nothing open are forgotten");
    }

    #[tokio::test(start_paused = true)]
    async fn a_source_opens_its_burst_at_once_then_at_its_rate() {
        let limits = SourceLimits {
            max_connections: usize::MAX,
            rate: Some(AcceptRate {
                per_second: 10,
                burst: 5,
            }),
        };
        let mut s = Sources::new(limits, 100);
        let opened = |s: &mut Sources| {
            (0..100)
                .take_while(|_| s.admit(v4(1), Instant::now()).is_ok())
                .count()
        };
        assert_eq!(opened(&mut s), 5, "the burst");
        assert_eq!(s.admit(v4(1), Instant::now()), Err(OverLimit::Rate));
        assert_eq!(
            s.admit(v4(2), Instant::now()),
            Ok(()),
            "others are not held"
        );
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(opened(&mut s), 5, "10 a second for half a second");
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(opened(&mut s), 5, "never more than the burst");
    }

    #[tokio::test(start_paused = true)]
    async fn the_table_forgets_refilled_sources_and_stays_bounded() {
        let limits = SourceLimits {
            max_connections: 8,
            rate: Some(AcceptRate {
                per_second: 1,
                burst: 2,
            }),
        };
        let cap = 10;
        let mut s = Sources::new(limits, cap);
        // Many sources each open and close one connection: their buckets are not full.
        for i in 0..=255u8 {
            for j in 0..40u8 {
                let src = Source::of(IpAddr::V4(Ipv4Addr::new(10, 0, i, j)));
                s.admit(src, Instant::now()).unwrap();
                s.closed(src);
                assert!(s.len() <= cap + SPARE_SOURCES, "{}", s.len());
            }
        }
        // One that keeps a connection open is never forgotten.
        s.admit(v4(1), Instant::now()).unwrap();
        tokio::time::advance(Duration::from_secs(5)).await;
        for j in 0..=255u8 {
            for k in 0..8u8 {
                let src = Source::of(IpAddr::V4(Ipv4Addr::new(11, k, 0, j)));
                s.admit(src, Instant::now()).unwrap();
                s.closed(src);
            }
        }
        assert_eq!(s.open(v4(1)), 1);
    }
}
