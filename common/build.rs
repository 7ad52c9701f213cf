//! Provenance of every rpcmesh program: the git commit and the cargo profile this crate is
//! built from, given to `rpcmesh_common::build` as `RPCMESH_COMMIT` and `RPCMESH_PROFILE`
//! (what `--version` prints and `rpcmesh_build_info` exports).
//!
//! The commit is `RPCMESH_BUILD_COMMIT` when set (a build from a source tarball that knows
//! its commit), else `git rev-parse` of the checkout, else `unknown`: a tarball without
//! `.git`, or a machine without git, still builds. The script runs again only when HEAD
//! moves (`.git/HEAD`, the branch's ref, `packed-refs`) or that variable changes, never
//! on an edit of a source file, so a rebuild costs what it did without it.

use std::path::PathBuf;
use std::process::Command;

/// Digits of the commit kept: unique in any repository of this size, short enough for a
/// label and a log line.
const COMMIT_DIGITS: usize = 12;

/// What `git ARGS` prints, trimmed, when it runs and succeeds.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

/// The files whose change means HEAD points at another commit: HEAD itself, the ref it
/// names (a worktree's HEAD and its branch's ref live in different folders: `--git-path`
/// knows where) and the packed refs. Only those that exist: a missing one would make cargo
/// run the script at every build.
fn head_files() -> Vec<PathBuf> {
    let mut paths = vec!["HEAD".to_string(), "packed-refs".to_string()];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        paths.push(branch);
    }
    paths
        .iter()
        .filter_map(|p| git(&["rev-parse", "--git-path", p]))
        .map(PathBuf::from)
        .filter(|p| p.exists())
        .collect()
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=RPCMESH_BUILD_COMMIT");
    let given = std::env::var("RPCMESH_BUILD_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty());
    let commit = match given {
        Some(c) => c.trim().to_string(),
        None => {
            for path in head_files() {
                println!("cargo:rerun-if-changed={}", path.display());
            }
            git(&["rev-parse", &format!("--short={COMMIT_DIGITS}"), "HEAD"])
                .unwrap_or_else(|| "unknown".to_string())
        }
    };
    println!("cargo:rustc-env=RPCMESH_COMMIT={commit}");
    // "release" for the release and bench profiles, "debug" for the others (cargo's rule).
    let profile = std::env::var("PROFILE").unwrap_or_else(|_| "unknown".to_string());
    println!("cargo:rustc-env=RPCMESH_PROFILE={profile}");
}
