//! The outside tools the system tier runs, and how a test that needs a missing one fails:
//! naming the Debian package that `scripts/deps` installs.

use std::path::{Path, PathBuf};

/// The path of `tool` on `PATH`; fails the test, naming the Debian `package` that
/// `scripts/deps` installs, when it is missing.
pub fn need_tool(tool: &str, package: &str) -> PathBuf {
    std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .map(|dir| Path::new(dir).join(tool))
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!("{tool} is not installed: run scripts/deps (Debian package {package})")
        })
}

/// Runs `systemd-analyze verify` on a unit file and fails the test unless it exits 0
/// and prints nothing (unknown keys and bad values are only warnings with exit 0).
pub fn systemd_analyze_verify(unit: &Path) {
    let analyze = need_tool("systemd-analyze", "systemd");
    let out = std::process::Command::new(analyze)
        .args(["verify", "--man=no"])
        .arg(unit)
        .output()
        .unwrap_or_else(|e| panic!("systemd-analyze: {e}"));
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let name = unit.display();
    assert!(out.status.success(), "{name}: {said}");
    assert!(said.trim().is_empty(), "{name}: {said}");
}
