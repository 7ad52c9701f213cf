//! The net layer: TCP connections that carry frames, and what every program does with them
//! the same way.
//!
//! - [`connection`]: one socket, its read buffer split into frames, its batching write
//!   buffer ([`connection::FramedIo`]).
//! - [`stream`]: the socket under a connection, plain or carrying TLS.
//! - [`tls`]: TLS: certificates and keys from files (read again when they change), the
//!   handshakes (timeout, cap, counted refusals), peers' identities.
//! - [`watch`]: files read again on SIGHUP and when they change.
//! - [`listener`]: the accept loop: connection cap, back-off when out of descriptors, one
//!   task per connection, drain on shutdown.
//! - [`sources`]: admission per source for the accept loop: connections open and a token
//!   bucket for the rate of new ones, per peer address (per /64 for IPv6).
//! - [`session`]: the server-session skeleton the provider and broker share: the loop,
//!   the write-backlog limit, the connection timeouts, the drain, the final flush.
//! - [`pace`]: how long one call takes on one connection (a lock-free moving average), and
//!   the heartbeat pair a provider reports it in.
//! - [`slots`]: the table of calls in flight on a multiplexed connection, by request id.
//! - [`busy_poll`]: keeping a worker polling after a read instead of sleeping.
//! - [`timer`]: a timer finer than Tokio's millisecond wheel (a `timerfd`), for simulated
//!   service times and the driver's pacer.
//! - [`client`]: a small multiplexed client, for tests and tools.
//! - [`backoff`]: capped exponential pauses with jitter, for every loop that reconnects.
//! - [`budget`]: the process's memory budget for buffered bytes.
//! - [`shutdown`]: SIGTERM/SIGINT and the cancellation token `run` hands to its tasks.
//! - [`thinned`]: log lines a peer can cause at will, thinned per process.
//!
//! Above the wire layer (`rpcmesh-wire`), which it uses to split and write frames; below
//! the metrics layer, which counts its events through the hooks it offers
//! ([`listener::AcceptObserver`], [`connection::IoCounts`], the busy poller's idle
//! callback) and which it never uses itself.

pub mod backoff;
pub mod budget;
pub mod busy_poll;
pub mod client;
pub mod connection;
pub mod listener;
pub mod pace;
pub mod session;
pub mod shutdown;
pub mod slots;
pub mod sources;
pub mod stream;
pub mod thinned;
pub mod timer;
pub mod tls;
pub mod watch;
