//! The system tier: tests of the whole repository that need more than Rust, each in
//! `tests/`: the deployment rehearsal (root, systemd-nspawn, a Debian image), Prometheus
//! and Grafana's rules and dashboards, the capacity report in headless Chromium,
//! HdrHistogram's Java log processor, systemd-analyze and the Ansible settings, the smoke
//! runs of the measurement scripts, and the hostile tests that measure rates, CPU or
//! memory over wall-clock windows. `scripts/deps` installs the tools; a test whose tool is
//! missing fails and says which package to install. Run with
//! `cargo test -p rpcmesh-system-tests`; plain `cargo test` (the fast tier) leaves this
//! crate out.
//!
//! This library holds what only these tests use, a module per job:
//!
//! ```text
//!   browser     headless Chromium: a page's DOM after its scripts ran
//!   tools       an outside tool or the package to install; systemd-analyze verify
//!   scripts     the measurement scripts' smoke runs and the rehearsal, from the root
//!   prometheus  a test's Prometheus server, started and asked through its HTTP API
//! ```
//!
//! What both tiers use (servers in process, spawned programs, waits) is `rpcmesh-testkit`.

pub mod browser;
pub mod prometheus;
pub mod scripts;
pub mod tools;

pub use browser::headless_dom;
pub use scripts::{
    ScriptRun, SmokeRun, lab_namespaces_left, program_dir, run_repo_command, run_script,
    smoke_script,
};
pub use tools::{need_tool, systemd_analyze_verify};
