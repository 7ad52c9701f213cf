//! The command-line layer every program shares: values and their parsers ([`values`]),
//! flag groups ([`flags`]; TLS and authorization's in [`security`]), the collecting of configuration problems ([`config`]), and the
//! start-up every `main` goes through ([`startup`]: logging, the runtime, binding, the
//! metrics endpoint, the shutdown signal), and what a server tells systemd ([`systemd`]:
//! ready, stopping, watchdog pings).
//!
//! The top layer of `rpcmesh-common`: it uses the others, and none of them uses it. Each
//! program's own flags, defaults and validation are its `config.rs`.

pub mod config;
pub mod flags;
pub mod security;
pub mod startup;
pub mod systemd;
pub mod values;

pub use config::{ConfigProblems, ConfigWarnings};
pub use values::{DurationArg, MetricsListen, OnOff, SizeArg};
