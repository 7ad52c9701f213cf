//! Where things are: the workspace's root, the programs' binaries (built on demand in the
//! test's own profile), free ports for programs that take an address on the command
//! line, and a file replaced by a named pipe (what a reload must not block on).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The workspace's root folder.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the test kit sits in the workspace")
        .to_path_buf()
}

/// Path of a workspace binary (`provider`, `broker`, `driver`) built in the same profile as
/// the running test, building it first if needed (a no-op after a `cargo test` of the
/// package that has it). Tests run the real programs as separate processes with this, and
/// stop them by PID.
pub fn bin_path(name: &str) -> PathBuf {
    built("", name, &["--bin", name])
}

/// Path of example `name` of workspace package `package` (`rpcmesh-broker`'s yardsticks
/// `floor` and `floor_epoll`), built in the same profile as the running test, first if
/// needed, as [`bin_path`] builds a program.
pub fn example_path(package: &str, name: &str) -> PathBuf {
    built("examples", name, &["-p", package, "--example", name])
}

/// `target/<profile>/<folder>/<name>`, built with `cargo build <what>` once per process.
fn built(folder: &str, name: &str, what: &[&str]) -> PathBuf {
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    // target/<profile>/deps/<test binary>
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test binary lives in target/<profile>/deps")
        .to_path_buf();
    let path = profile_dir.join(folder).join(name);
    let key = format!("{folder}/{name}");
    let mut built = BUILT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !built.contains(&key) {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let release = profile_dir.file_name().is_some_and(|p| p == "release");
        let manifest = workspace_root().join("Cargo.toml");
        let mut cmd = std::process::Command::new(cargo);
        cmd.args(["build", "--quiet", "--manifest-path"])
            .arg(manifest)
            .args(what);
        if release {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success(), "cargo build {} failed", what.join(" "));
        built.push(key);
    }
    assert!(path.exists(), "{} missing after build", path.display());
    path
}

/// Lowest port [`free_port`] hands out: above the well-known and most registered ones.
const FREE_PORT_MIN: u16 = 10_000;

/// Where the kernel's ephemeral ports begin when `/proc` does not say (Linux's default).
const DEFAULT_EPHEMERAL_MIN: u16 = 32_768;

/// A free TCP port on 127.0.0.1 (bound and released; for programs that take an address
/// on the command line). Between its release and the program's bind the port must stay
/// free, so it is drawn at random from below the kernel's ephemeral range: the port-0
/// listeners of the servers running in this process and the source ports of every
/// outgoing connection come from that range and cannot take it meanwhile. A port is
/// handed out once per process.
pub fn free_port() -> u16 {
    static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let ephemeral_min = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(DEFAULT_EPHEMERAL_MIN);
    let mut given = GIVEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if ephemeral_min > FREE_PORT_MIN + 1000 {
        for _ in 0..1000 {
            let port = fastrand::u16(FREE_PORT_MIN..ephemeral_min);
            if !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                given.push(port);
                return port;
            }
        }
    }
    // An unusual ephemeral range: let the kernel choose.
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind port 0");
    l.local_addr().expect("local addr").port()
}

/// Replaces the file at `path` with a named pipe, as an editor's rename would: made beside
/// it, then renamed over it. Opening it for reading blocks until someone writes to it.
pub fn replace_with_fifo(path: &Path) {
    let pipe = path.with_extension("fifo");
    let _ = std::fs::remove_file(&pipe);
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        &pipe,
        rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR,
    )
    .expect("a named pipe");
    std::fs::rename(&pipe, path).expect("the pipe renamed over the file");
}
