//! Which build this is: the version, the git commit and the cargo profile, fixed at
//! compile time by `common/build.rs`. Every program prints them for `--version`
//! ([`VERSION_LINE`]) and exports them as `rpcmesh_build_info{role, version, commit}`
//! (registered with the system metrics), so that a deployment can tell which build a host
//! *runs*, not only which one it has on disk.
//!
//! Pure constants: the commit is `unknown` for a build without git history (a source
//! tarball), and says nothing of uncommitted changes: the manifest written beside the
//! binaries (`scripts/manifest`) holds the SHA-256 that tells two such builds apart.

/// The workspace version (`Cargo.toml`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The git commit, 12 hex digits, or `unknown`.
pub const COMMIT: &str = env!("RPCMESH_COMMIT");
/// The cargo profile: `release` or `debug`.
pub const PROFILE: &str = env!("RPCMESH_PROFILE");
/// What `--version` prints after the program's name:
/// `0.1.0 (commit 5a80240abcd1, release build)`.
pub const VERSION_LINE: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("RPCMESH_COMMIT"),
    ", ",
    env!("RPCMESH_PROFILE"),
    " build)"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_line_names_version_commit_and_profile() {
        assert!(VERSION_LINE.starts_with(VERSION), "{VERSION_LINE}");
        assert!(
            VERSION_LINE.contains(&format!("commit {COMMIT}")),
            "{VERSION_LINE}"
        );
        assert!(VERSION_LINE.contains(PROFILE), "{VERSION_LINE}");
        // Built from a git checkout (as the tests are), the commit is HEAD's, not the
        // fallback.
        let checkout = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.git");
        if checkout.exists() && option_env!("RPCMESH_BUILD_COMMIT").is_none() {
            assert!(
                COMMIT.len() == 12 && COMMIT.chars().all(|c| c.is_ascii_hexdigit()),
                "{COMMIT}"
            );
        }
        assert!(PROFILE == "debug" || PROFILE == "release", "{PROFILE}");
    }
}
