//! The short `driver capacity` experiment both tiers run: a search with compression off and
//! on, and a sweep, against the driver's own local mesh. The fast tier checks its figures,
//! JSON and schema (`driver/tests/capacity.rs`), the system tier that a browser draws its
//! HTML report's charts (`system-tests/tests/capacity_browser.rs`).
//!
//! The capacity is made small and independent of the machine's speed: the provider sleeps
//! 2 ms per call, a request is 5 calls in a row, and at most 4 requests are in flight, so
//! the path holds about 4 / 10 ms = 400 requests/s whatever the CPU; offered more, the
//! backlog grows and p99 (from the intended start) passes the SLO's 100 ms.

use std::path::Path;
use std::process::{Command, Output};

/// The flags of the short experiment (see the module doc): the load and its SLO, the
/// search's bounds and step lengths, the comparison and a three-point sweep, within a time
/// budget far above what it takes; no `/metrics` of its own.
const SHORT_CAPACITY_SEARCH: [&str; 26] = [
    "capacity",
    "--service-time",
    "2ms",
    "--concurrency",
    "4",
    "--connections",
    "2",
    "--slo",
    "p99<=100ms,errors<=1%",
    "--start-rate",
    "100",
    "--growth",
    "4",
    "--precision",
    "0.3",
    "--step-duration",
    "1.5s",
    "--warmup",
    "0.5s",
    "--compare-compression",
    "--sweep",
    "1,2,4",
    "--time-limit",
    "3m",
    "--metrics-listen",
    "off",
];

/// Runs the short experiment with the `driver` binary, writing each report named in
/// `reports` (its flag, `--json`, `--markdown` or `--html`, and its path); returns what
/// the driver printed and how it exited.
pub fn short_capacity_search(driver: &Path, reports: &[(&str, &Path)]) -> Output {
    let mut cmd = Command::new(driver);
    cmd.args(SHORT_CAPACITY_SEARCH);
    for (flag, path) in reports {
        cmd.arg(flag).arg(path);
    }
    cmd.output()
        .unwrap_or_else(|e| panic!("run {}: {e}", driver.display()))
}

/// The short experiment's flags with TLS compared instead of compression, and no sweep:
/// the local mesh then runs a plaintext and a mutual-TLS pair side by side.
pub fn short_tls_comparison() -> Vec<&'static str> {
    let mut argv = Vec::with_capacity(SHORT_CAPACITY_SEARCH.len());
    let mut flags = SHORT_CAPACITY_SEARCH.iter().copied().peekable();
    while let Some(f) = flags.next() {
        match f {
            "--compare-compression" => argv.push("--compare-tls"),
            "--sweep" => {
                flags.next();
                argv.extend(["--sweep", "off"]);
            }
            _ => argv.push(f),
        }
    }
    argv
}
