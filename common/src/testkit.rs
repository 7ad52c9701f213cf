//! Test support shared by the provider's, broker's and driver's black-box tests (feature
//! `test-support`): servers run in the test process ([`InProcess`]), waiting on a
//! condition instead of sleeping ([`wait_until`], [`wait_for`]), a [`Gate`] that holds
//! calls until the test lets them through, the catalogue of bad inputs every server must
//! survive, and a probe that sends one on a fresh connection and reports what came back.
//!
//! The tests prove order and causality, never how long something took: a test waits for
//! the condition it needs, and the only deadlines here are hang detectors that fail a
//! stuck test.

use crate::net::shutdown::ShutdownSignal;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinHandle;

use rpcmesh_wire::body::Request;
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::frame::{Flags, Frame};
use rpcmesh_wire::proto::rpc::EchoRequest;

use crate::metrics::catalogue::{CALLS_TOTAL, ERRORS_TOTAL};
use crate::metrics::recorder::sample;
use crate::metrics::{ErrorKind, Telemetry};
use crate::net::client::{Client, ClientError, Reply};

/// A server (a provider's or a broker's `run_with`) running in the test process on
/// 127.0.0.1 port 0, with its own metrics, until [`InProcess::stop`].
#[derive(Debug)]
pub struct InProcess<T> {
    /// Where it listens.
    pub addr: std::net::SocketAddr,
    /// Its metrics.
    pub telemetry: Telemetry,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<T>,
}

impl<T: Send + 'static> InProcess<T> {
    /// Binds a listener and spawns `run(listener, telemetry, stop)`.
    pub async fn start<F, Fut>(run: F) -> InProcess<T>
    where
        F: FnOnce(TcpListener, Telemetry, ShutdownSignal) -> Fut,
        Fut: Future<Output = T> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local address");
        let telemetry = Telemetry::new();
        let (stop, rx) = oneshot::channel::<()>();
        let signal: ShutdownSignal = Box::pin(async {
            let _ = rx.await;
        });
        let task = tokio::spawn(run(listener, telemetry.clone(), signal));
        InProcess {
            addr,
            telemetry,
            stop: Some(stop),
            task,
        }
    }

    /// The sum of the samples of metric `name` whose labels include `labels`, so far
    /// (0 when there is none).
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        sample(&self.telemetry.render(), name, labels).unwrap_or(0.0)
    }

    /// `rpcmesh_errors_total{kind}` so far, every side.
    pub fn errors(&self, kind: &str) -> f64 {
        self.metric(ERRORS_TOTAL.name, &[("kind", kind)])
    }

    /// `rpcmesh_errors_total{kind, side}` so far.
    pub fn errors_from(&self, kind: &str, side: &str) -> f64 {
        self.metric(ERRORS_TOTAL.name, &[("kind", kind), ("side", side)])
    }

    /// `rpcmesh_calls_total{status}` so far.
    pub fn calls(&self, status: &str) -> f64 {
        self.metric(CALLS_TOTAL.name, &[("status", status)])
    }

    /// Tells it to stop (it drains), without waiting.
    pub fn signal_stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }

    /// Tells it to stop and waits for what it returns.
    pub async fn stop(mut self) -> T {
        self.signal_stop();
        self.task.await.expect("server task")
    }
}

/// Starts an echo call carrying `message` on `c`, in the background.
pub fn echo_call(c: &Client, message: impl Into<String>) -> JoinHandle<Result<Reply, ClientError>> {
    let (c, message) = (c.clone(), message.into());
    tokio::spawn(async move {
        c.call("EchoService", "Echo", &EchoRequest { message })
            .await
    })
}

/// Starts `n` echo calls at once on `c`, call `i` carrying the message `m{i}`; await the
/// handles in order to check each reply.
pub fn echo_calls(c: &Client, n: usize) -> Vec<JoinHandle<Result<Reply, ClientError>>> {
    (0..n).map(|i| echo_call(c, format!("m{i}"))).collect()
}

/// How long [`wait_until`] and [`wait_for`] wait before they fail the test: a hang
/// detector, not a measurement. Every condition waited on normally holds within
/// milliseconds; 30 s is far beyond what a loaded 2-core machine needs, and short enough
/// that a hung test fails on its own instead of stalling the run.
pub const WAIT_TIMEOUT: Duration = Duration::from_secs(30);

/// How often [`wait_until`] and [`wait_for`] look again: often enough that waiting costs
/// the test nothing noticeable, rarely enough not to load the machine it waits on.
pub const WAIT_POLL: Duration = Duration::from_millis(10);

/// Waits until `condition` holds, looking every [`WAIT_POLL`]; fails the test, naming
/// `what`, if it still does not after [`WAIT_TIMEOUT`].
pub async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    wait_for(what, || std::future::ready(condition().then_some(()))).await;
}

/// Runs `probe` until it yields a value, and returns it; looks every [`WAIT_POLL`] and
/// fails the test, naming `what`, after [`WAIT_TIMEOUT`]. For conditions that take I/O to
/// check (a call, a connection attempt).
pub async fn wait_for<T, F, Fut>(what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    // Wall time on purpose: the deadline stops a hung test, whatever clock the test runs.
    let give_up = std::time::Instant::now() + WAIT_TIMEOUT;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            std::time::Instant::now() < give_up,
            "timed out after {WAIT_TIMEOUT:?} waiting for {what}"
        );
        tokio::time::sleep(WAIT_POLL).await;
    }
}

/// Looks every `every` until `f` holds, from a plain (non-async) test; false if it still
/// does not after `timeout`.
pub fn eventually(timeout: Duration, every: Duration, mut f: impl FnMut() -> bool) -> bool {
    // Wall time on purpose: the deadline only stops a hung test.
    let end = std::time::Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if std::time::Instant::now() >= end {
            return false;
        }
        std::thread::sleep(every);
    }
}

/// [`wait_until`] for a plain (non-async) test: looks every [`WAIT_POLL`] and fails the
/// test, naming `what`, after [`WAIT_TIMEOUT`].
pub fn wait_until_blocking(what: &str, f: impl FnMut() -> bool) {
    assert!(
        eventually(WAIT_TIMEOUT, WAIT_POLL, f),
        "timed out after {WAIT_TIMEOUT:?} waiting for {what}"
    );
}

/// Waits until nothing accepts connections on `addr` any more (a draining server has
/// closed its listener); fails the test after [`WAIT_TIMEOUT`].
pub async fn wait_refused(addr: std::net::SocketAddr) {
    let what = format!("{addr} to refuse new connections");
    wait_for(&what, || async {
        TcpStream::connect(addr).await.is_err().then_some(())
    })
    .await;
}

/// Waits until `addr` accepts connections (a server process has started); panics after
/// [`WAIT_TIMEOUT`].
pub async fn wait_listening(addr: std::net::SocketAddr) {
    let what = format!("{addr} to accept connections");
    wait_for(&what, || async {
        TcpStream::connect(addr).await.is_ok().then_some(())
    })
    .await;
}

/// Holds calls until the test opens it: a slow server whose calls finish when the test
/// says, not after a sleep, so that "answered while that call was still in flight" is a
/// fact of the test rather than a race against a timer. A handler calls [`Gate::hold`]
/// and awaits what it returns before answering; the test waits for [`Gate::arrived`] to
/// know the calls are in flight, and [`Gate::open`]s it to let them (and all later ones)
/// through.
#[derive(Debug)]
pub struct Gate {
    /// No permits, ever: waiters pass when it is closed.
    shut: Semaphore,
    arrived: AtomicUsize,
}

impl Gate {
    /// A closed gate.
    pub fn new() -> Arc<Gate> {
        Arc::new(Gate {
            shut: Semaphore::new(0),
            arrived: AtomicUsize::new(0),
        })
    }

    /// Counts a call as arrived, now, and returns what it awaits: resolves once the gate
    /// is open.
    pub fn hold(self: &Arc<Self>) -> impl Future<Output = ()> + Send + use<> {
        self.arrived.fetch_add(1, Ordering::SeqCst);
        let gate = Arc::clone(self);
        async move {
            // Never a permit: an error is the gate opening.
            let _ = gate.shut.acquire().await;
        }
    }

    /// What a handler calls for each call it holds (a `hold` for provider's `Held`): the
    /// call counts as arrived and waits for the gate.
    pub fn holder(
        self: &Arc<Self>,
    ) -> impl Fn() -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync + 'static
    {
        let gate = Arc::clone(self);
        move || Box::pin(gate.hold())
    }

    /// Calls that have reached the gate so far (held, or let through since).
    pub fn arrived(&self) -> usize {
        self.arrived.load(Ordering::SeqCst)
    }

    /// Lets every held call through, and every later one straight through.
    pub fn open(&self) {
        self.shut.close();
    }
}

/// How long a probe waits for the server to answer or close.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// One kind of bad input and what a server must do with it.
#[derive(Debug, Clone)]
pub struct BadInput {
    /// Name for assertion messages.
    pub name: &'static str,
    /// Bytes to send.
    pub bytes: Vec<u8>,
    /// Close our write side after sending (a frame cut off by close).
    pub close_after: bool,
    /// The error kind the server must count.
    pub kind: ErrorKind,
    /// Request id of an error reply the server must send, if one is possible.
    pub reply_to: Option<u64>,
    /// True when the server must close the connection.
    pub closes: bool,
    /// A request id that must still be answered normally after the bad frame.
    pub then_answered: Option<u64>,
}

/// A well-formed echo request frame.
pub fn echo_request(req_id: u64, message: &str) -> BytesMut {
    let mut b = BytesMut::new();
    let payload = prost::Message::encode_to_vec(&rpcmesh_wire::proto::rpc::RpcRequest {
        payload: prost::Message::encode_to_vec(&EchoRequest {
            message: message.into(),
        })
        .into(),
        metadata: Default::default(),
    });
    Request {
        service: Bytes::from_static(b"EchoService"),
        method: Bytes::from_static(b"Echo"),
        payload: payload.into(),
    }
    .put(&mut b, Flags::NONE, req_id)
    .expect("a small request encodes");
    b
}

fn fix_crc(b: &mut BytesMut) {
    let n = b.len();
    let crc = crc32fast::hash(&b[..n - 4]);
    b[n - 4..].copy_from_slice(&crc.to_be_bytes());
}

/// Deterministic pseudo-random bytes with no `"RPCF"` in them.
pub fn garbage(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    for b in &mut v {
        if *b == b'R' {
            *b = b'r';
        }
    }
    v
}

/// The catalogue: bad magic, bad version, CRC mismatch, `body_len` over `max_body_len`, a
/// frame cut off by close, and random garbage.
pub fn bad_inputs(max_body_len: u32) -> Vec<BadInput> {
    let mut version = echo_request(11, "v");
    version[4] = 2;
    fix_crc(&mut version);

    let mut crc = echo_request(12, "crc");
    let n = crc.len();
    crc[n - 1] ^= 0x5a;
    crc.extend_from_slice(&echo_request(13, "after"));

    let mut too_large = echo_request(14, "big");
    too_large[6..10].copy_from_slice(&(max_body_len + 1).to_be_bytes());
    too_large.truncate(18);

    let whole = echo_request(15, "cut off by close");
    let cut = whole[..whole.len() - 7].to_vec();

    vec![
        BadInput {
            name: "bad magic",
            bytes: b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
            close_after: false,
            kind: ErrorKind::BadMagic,
            reply_to: None,
            closes: true,
            then_answered: None,
        },
        BadInput {
            name: "bad version",
            bytes: version.to_vec(),
            close_after: false,
            kind: ErrorKind::BadVersion,
            reply_to: None,
            closes: true,
            then_answered: None,
        },
        BadInput {
            name: "crc mismatch",
            bytes: crc.to_vec(),
            close_after: false,
            kind: ErrorKind::Crc,
            reply_to: Some(12),
            closes: false,
            then_answered: Some(13),
        },
        BadInput {
            name: "body_len over the limit",
            bytes: too_large.to_vec(),
            close_after: false,
            kind: ErrorKind::TooLarge,
            reply_to: Some(14),
            closes: true,
            then_answered: None,
        },
        BadInput {
            name: "frame cut off by close",
            bytes: cut,
            close_after: true,
            kind: ErrorKind::Truncated,
            reply_to: None,
            closes: true,
            then_answered: None,
        },
        BadInput {
            name: "random garbage",
            bytes: garbage(4096, 0x5eed),
            close_after: false,
            kind: ErrorKind::BadMagic,
            reply_to: None,
            closes: true,
            then_answered: None,
        },
    ]
}

/// What a probe saw.
#[derive(Debug, Default)]
pub struct Observed {
    /// Frames the server sent back.
    pub frames: Vec<Frame>,
    /// True when the server closed the connection.
    pub closed: bool,
}

/// Sends `input` on a fresh connection to `addr` and collects the server's frames until it
/// closes the connection, or until it has answered everything expected and stayed open.
pub async fn probe(addr: std::net::SocketAddr, input: &BadInput) -> std::io::Result<Observed> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(&input.bytes).await?;
    if input.close_after {
        s.shutdown().await?;
    }
    let expected =
        usize::from(input.reply_to.is_some()) + usize::from(input.then_answered.is_some());
    let codec = FrameCodec::default();
    let mut buf = BytesMut::new();
    let mut seen = Observed::default();
    let deadline = tokio::time::Instant::now() + PROBE_TIMEOUT;
    loop {
        if !input.closes && seen.frames.len() >= expected {
            return Ok(seen);
        }
        let n = match tokio::time::timeout_at(deadline, s.read_buf(&mut buf)).await {
            Err(_) => return Ok(seen),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => 0,
            Ok(r) => r?,
        };
        while let Ok(Some(f)) = codec.decode_frame(&mut buf) {
            seen.frames.push(f);
        }
        if n == 0 {
            seen.closed = true;
            return Ok(seen);
        }
    }
}

/// Path of a workspace binary (`provider`, `broker`, `driver`) built in the same profile as
/// the running test, building it first if needed. Tests run the real programs as separate
/// processes with this, and stop them by PID.
pub fn bin_path(name: &str) -> std::path::PathBuf {
    use std::sync::{Mutex, OnceLock};
    static BUILT: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    // target/<profile>/deps/<test binary>
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test binary lives in target/<profile>/deps")
        .to_path_buf();
    let path = profile_dir.join(name);
    let built = BUILT.get_or_init(|| Mutex::new(Vec::new()));
    let mut built = built
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !built.iter().any(|b| b == name) {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let release = profile_dir.file_name().is_some_and(|p| p == "release");
        let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");
        let mut cmd = std::process::Command::new(cargo);
        cmd.args([
            "build",
            "--quiet",
            "--manifest-path",
            manifest,
            "--bin",
            name,
        ]);
        if release {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success(), "cargo build --bin {name} failed");
        built.push(name.to_string());
    }
    assert!(path.exists(), "{} missing after build", path.display());
    path
}

/// A child process killed (SIGKILL) and reaped when dropped, so that a failing test leaves
/// nothing behind.
#[derive(Debug)]
pub struct ChildGuard(pub Option<std::process::Child>);

impl ChildGuard {
    /// Starts `program` with `args`, stdout and stderr inherited.
    pub fn spawn(program: &std::path::Path, args: &[&str]) -> std::io::Result<ChildGuard> {
        let child = std::process::Command::new(program).args(args).spawn()?;
        Ok(ChildGuard(Some(child)))
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.0.as_ref().map_or(0, std::process::Child::id)
    }

    /// Sends a signal by PID (e.g. `libc::SIGTERM`), via the `kill` command.
    pub fn signal(&self, sig: &str) {
        let _ = std::process::Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status();
    }

    /// Waits for the process to exit, up to `timeout`; returns its exit status.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let child = self.0.as_mut()?;
        let end = std::time::Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                self.0 = None;
                return Some(st);
            }
            if std::time::Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Request metadata with `entries` empty entries (`k0`, `k1`...): a "metadata bomb", cheap
/// to send and, without the metadata limit, costly to decode.
pub fn metadata_bomb(entries: usize) -> std::collections::HashMap<String, String> {
    (0..entries)
        .map(|i| (format!("k{i}"), String::new()))
        .collect()
}

/// The path of `tool` on `PATH`; fails the test, naming the Debian `package` that
/// `scripts/deps` installs, when it is missing.
pub fn need_tool(tool: &str, package: &str) -> std::path::PathBuf {
    std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .map(|dir| std::path::Path::new(dir).join(tool))
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!("{tool} is not installed: run scripts/deps (Debian package {package})")
        })
}

/// Runs `systemd-analyze verify` on a unit file and fails the test unless it exits 0
/// and prints nothing (unknown keys and bad values are only warnings with exit 0).
pub fn systemd_analyze_verify(unit: &std::path::Path) {
    need_tool("systemd-analyze", "systemd");
    let out = std::process::Command::new("systemd-analyze")
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

/// A plain HTTP/1.0 GET on 127.0.0.1 (so that the answer is never chunked): the status
/// code and the body, or None if nothing answers.
pub fn http(to: std::net::SocketAddr, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let code = head
        .strip_prefix("HTTP/1.")?
        .split(' ')
        .nth(1)?
        .parse()
        .ok()?;
    Some((code, body.to_string()))
}

/// `s` percent-encoded for a URL's query (every byte but the unreserved ones).
pub fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A provider or broker run as a real process on 127.0.0.1 port 0 (its RPC and metrics
/// addresses read from its listening line), killed by PID when dropped.
#[derive(Debug)]
pub struct Spawned {
    /// The process.
    pub child: ChildGuard,
    /// Where it takes calls.
    pub rpc: std::net::SocketAddr,
    /// Where it serves `/metrics`, unless started with `--metrics-listen off`.
    pub metrics: Option<std::net::SocketAddr>,
}

impl Spawned {
    /// Starts workspace binary `name` listening on 127.0.0.1 port 0 for calls and for
    /// metrics, with `args` after, and waits for its listening line. Its later output on
    /// stdout is read and dropped, its stderr discarded.
    pub fn start(name: &str, args: &[&str]) -> Spawned {
        Spawned::start_with(&[], name, args, None)
    }

    /// As [`Spawned::start`], run through `wrapper` (a command that execs the rest, such
    /// as `prlimit --nofile=64`), with stderr written to `stderr` if given.
    pub fn start_with(
        wrapper: &[&str],
        name: &str,
        args: &[&str],
        stderr: Option<&std::path::Path>,
    ) -> Spawned {
        Spawned::spawn(wrapper, name, "127.0.0.1:0", args, stderr)
    }

    /// As [`Spawned::start`], taking calls on `listen` (an address of the test's, e.g. from
    /// [`free_port`]), so that the program can be stopped and started again on the same
    /// address, as a supervisor restarts it.
    pub fn start_at(name: &str, listen: std::net::SocketAddr, args: &[&str]) -> Spawned {
        Spawned::spawn(&[], name, &listen.to_string(), args, None)
    }

    fn spawn(
        wrapper: &[&str],
        name: &str,
        listen: &str,
        args: &[&str],
        stderr: Option<&std::path::Path>,
    ) -> Spawned {
        use std::io::BufRead;
        let program = bin_path(name);
        let mut cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = std::process::Command::new(first);
                c.args(rest).arg(&program);
                c
            }
            None => std::process::Command::new(&program),
        };
        let err = match stderr {
            Some(path) => std::fs::File::create(path)
                .map(std::process::Stdio::from)
                .expect("create the stderr file"),
            None => std::process::Stdio::null(),
        };
        let mut child = cmd
            .args(["--listen", listen, "--metrics-listen", "127.0.0.1:0"])
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let child = ChildGuard(Some(child));
        let mut lines = std::io::BufReader::new(stdout).lines();
        let (rpc, metrics) = lines
            .by_ref()
            .map_while(Result::ok)
            .find_map(|l| crate::cli::startup::parse_listening_line(&l))
            .unwrap_or_else(|| panic!("{name} printed no listening line"));
        std::thread::spawn(move || lines.for_each(drop));
        Spawned {
            child,
            rpc,
            metrics,
        }
    }

    /// CPU time the process has used so far (user + system), in seconds.
    pub fn cpu_seconds(&self) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()))
            .expect("the process is running");
        // Fields after the command name, which is in parentheses and may hold spaces.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: f64 = [11, 12]
            .iter()
            .filter_map(|&i| f.get(i)?.parse::<f64>().ok())
            .sum();
        ticks / CLOCK_TICKS_PER_SECOND
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// Its `/metrics` text now (empty when nothing answers).
    pub fn scrape(&self) -> String {
        self.metrics
            .and_then(|addr| http(addr, "/metrics"))
            .map(|(_, body)| body)
            .unwrap_or_default()
    }

    /// The value of a metric (summed over the matching series; 0 when there is none).
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        sample(&self.scrape(), name, labels).unwrap_or(0.0)
    }

    /// A line of `/proc/PID/status` (`VmRSS`, `VmSize`...), in KiB.
    pub fn status_kib(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("the process is running");
        status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{field} in /proc/PID/status"))
    }
}

/// The kernel's `USER_HZ`, the unit of `/proc/PID/stat`'s CPU times (100 on every Linux
/// build this runs on).
const CLOCK_TICKS_PER_SECOND: f64 = 100.0;

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
    use std::sync::Mutex;
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

/// A request frame whose payload is the zlib of `RpcRequest { payload: inner }`, flagged
/// `COMPRESSED` plus `flags`: small on the wire whatever `inner` inflates to.
pub fn compressed_request(
    req_id: u64,
    flags: Flags,
    service: &'static str,
    method: &'static str,
    inner: &impl prost::Message,
) -> BytesMut {
    let envelope = prost::Message::encode_to_vec(&rpcmesh_wire::proto::rpc::RpcRequest {
        payload: prost::Message::encode_to_vec(inner).into(),
        metadata: Default::default(),
    });
    let mut z = BytesMut::new();
    let mut c =
        rpcmesh_wire::compress::Compressor::new(rpcmesh_wire::compress::CompressionConfig {
            threshold: 1,
            level: 6,
        });
    assert!(c.compress_into(&envelope, &mut z), "the payload compresses");
    let mut b = BytesMut::new();
    Request {
        service: Bytes::from_static(service.as_bytes()),
        method: Bytes::from_static(method.as_bytes()),
        payload: z.freeze(),
    }
    .put(&mut b, flags | Flags::COMPRESSED, req_id)
    .expect("a small request encodes");
    b
}

/// Reads frames from `s` into `buf` until `n` whole ones have arrived (each read waits at
/// most [`PROBE_TIMEOUT`]).
pub async fn read_frames(
    s: &mut TcpStream,
    buf: &mut BytesMut,
    n: usize,
) -> std::io::Result<Vec<Frame>> {
    let codec = FrameCodec::default();
    let mut frames = Vec::new();
    while frames.len() < n {
        while let Some(f) = codec
            .decode_frame(buf)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?
        {
            frames.push(f);
        }
        if frames.len() >= n {
            break;
        }
        let read = tokio::time::timeout(PROBE_TIMEOUT, s.read_buf(buf))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
        if read == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(frames)
}

/// A golden frame of the reference implementation, by its name in
/// `common/wire/tests/data/vectors.txt`.
pub fn golden(name: &str) -> Vec<u8> {
    let text = include_str!("../wire/tests/data/vectors.txt");
    let hex = text
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no golden frame named {name}"));
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect()
}

/// Sends a golden request on a fresh connection and returns as many bytes as the golden
/// reply has (or fails after [`PROBE_TIMEOUT`]).
pub async fn golden_exchange(
    addr: std::net::SocketAddr,
    request: &str,
    reply: &str,
) -> std::io::Result<(Vec<u8>, Vec<u8>)> {
    let (req, want) = (golden(request), golden(reply));
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(&req).await?;
    let mut got = vec![0u8; want.len()];
    tokio::time::timeout(PROBE_TIMEOUT, s.read_exact(&mut got))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    Ok((got, want))
}

/// The workspace's root folder.
pub fn workspace_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("common sits in the workspace")
        .to_path_buf()
}

/// The folder of provider, broker and driver built in the profile the tests run in (each
/// through [`bin_path`], a no-op after `cargo test --workspace`, which built them): what
/// the measurement scripts' smoke runs and the deployment rehearsal get as `--bin-dir`.
/// Their full runs use release builds; a smoke run checks that everything runs, and a
/// release build from scratch would cost CI about five minutes.
pub fn program_dir() -> std::path::PathBuf {
    for name in ["provider", "broker"] {
        bin_path(name);
    }
    let driver = bin_path("driver");
    driver
        .parent()
        .expect("a binary sits in its profile's folder")
        .to_path_buf()
}

/// What a script run by [`run_script`] did.
#[derive(Debug)]
pub struct ScriptRun {
    /// Its exit status.
    pub status: std::process::ExitStatus,
    /// What it printed on stdout.
    pub stdout: String,
    /// Both outputs, labelled, for assertion messages.
    pub output: String,
}

/// Runs `scripts/<name> args...` from the workspace root, its output to files (nothing can
/// block on a full pipe), and kills it if it runs past `timeout` (a hang detector: the
/// scripts bound their own waits). Panics if it cannot be started (python3 missing).
pub fn run_script(name: &str, args: &[&std::ffi::OsStr], timeout: Duration) -> ScriptRun {
    run_repo_command(&format!("scripts/{name}"), args, timeout)
}

/// Runs the workspace's command at `path` (relative to the workspace root, e.g.
/// `deploy/rehearse`) with `args`, as [`run_script`] does: from the root, output to files,
/// killed past `timeout`.
pub fn run_repo_command(path: &str, args: &[&std::ffi::OsStr], timeout: Duration) -> ScriptRun {
    let root = workspace_root();
    let name = path.rsplit('/').next().unwrap_or(path);
    let dir = std::env::temp_dir().join(format!("rpcmesh-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a folder for the script's output");
    let (out, err) = (dir.join("stdout.txt"), dir.join("stderr.txt"));
    let mut child = std::process::Command::new(root.join(path))
        .args(args)
        .current_dir(&root)
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&err).expect("stderr file"))
        .spawn()
        .unwrap_or_else(|e| panic!("run {path} (python3 must be installed): {e}"));
    // Wall time on purpose: the deadline stops a hung script.
    let deadline = std::time::Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the script") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{path} still running after {timeout:?}; killed");
        }
        std::thread::sleep(WAIT_POLL);
    };
    let stdout = std::fs::read_to_string(&out).unwrap_or_default();
    let output = format!(
        "--- stdout\n{stdout}\n--- stderr\n{}",
        std::fs::read_to_string(&err).unwrap_or_default()
    );
    let _ = std::fs::remove_dir_all(&dir);
    ScriptRun {
        status,
        stdout,
        output,
    }
}

/// A measurement script's smoke run: what it did, and the folder it wrote its reports to
/// (removed when this is dropped).
#[derive(Debug)]
pub struct SmokeRun {
    /// The run, which exited 0.
    pub run: ScriptRun,
    /// Where its reports are.
    pub out: std::path::PathBuf,
}

impl SmokeRun {
    /// The report it wrote whose name starts with `prefix` and ends in `.ext`, read as text;
    /// panics, with the script's output, if there is none.
    pub fn report(&self, prefix: &str, ext: &str) -> String {
        let path = std::fs::read_dir(&self.out)
            .expect("the reports' folder")
            .map(|e| e.expect("a folder entry").path())
            .find(|p| {
                p.extension().is_some_and(|e| e == ext)
                    && p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with(prefix))
            })
            .unwrap_or_else(|| {
                panic!(
                    "no {prefix}*.{ext} in {}\n{}",
                    self.out.display(),
                    self.run.output
                )
            });
        std::fs::read_to_string(path).expect("read the report")
    }
}

impl Drop for SmokeRun {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.out);
    }
}

/// Runs `scripts/<name> --smoke --bin-dir BINS --out DIR` on the tests' build of the
/// programs ([`program_dir`]), DIR a fresh folder under `tmp` (a test's
/// `CARGO_TARGET_TMPDIR`), and asserts that it exited 0; `timeout` as in [`run_script`].
pub fn smoke_script(name: &str, tmp: &std::path::Path, timeout: Duration) -> SmokeRun {
    let bins = program_dir();
    let out = tmp.join(format!("{name}-smoke-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).expect("a folder for the reports");
    let run = run_script(
        name,
        &[
            "--smoke".as_ref(),
            "--bin-dir".as_ref(),
            bins.as_os_str(),
            "--out".as_ref(),
            out.as_os_str(),
        ],
        timeout,
    );
    assert!(
        run.status.success(),
        "scripts/{name} --smoke failed ({})\n{}",
        run.status,
        run.output
    );
    SmokeRun { run, out }
}

/// How long [`headless_dom`] lets Chromium run before it kills it: a hang detector (one
/// run takes about a second).
pub const HEADLESS_TIMEOUT: Duration = Duration::from_secs(60);

/// The DOM of the HTML file `html` as headless Chromium serialises it after the page's
/// scripts ran (`chromium --headless --dump-dom`; Debian package `chromium`, which
/// `scripts/deps` installs; `$CHROMIUM` names another binary). Each run has a throwaway
/// profile, cache and config folder under the temporary folder, removed afterwards.
/// Chromium runs in its own process group, killed (SIGKILL, by its id) with every helper
/// process it started if it runs past [`HEADLESS_TIMEOUT`]; that is a `TimedOut` error.
/// What it says on stderr (D-Bus and crash-reporter complaints, in a container) is only
/// quoted in errors, never a failure by itself.
pub fn headless_dom(html: &std::path::Path) -> std::io::Result<String> {
    use std::os::unix::process::CommandExt as _;
    static RUN: AtomicUsize = AtomicUsize::new(0);
    let html = std::fs::canonicalize(html)?;
    let dir = std::env::temp_dir().join(format!(
        "rpcmesh-chromium-{}-{}",
        std::process::id(),
        RUN.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let (out, err) = (dir.join("dom.html"), dir.join("stderr.txt"));
    let program = std::env::var_os("CHROMIUM").unwrap_or_else(|| "chromium".into());
    let spawned = std::process::Command::new(&program)
        .args([
            "--headless",
            // Root in a container: Chromium's sandbox needs user namespaces it lacks.
            "--no-sandbox",
            "--disable-gpu",
            // A container's /dev/shm is often 64 MB, too small for the renderer.
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
        ])
        .arg(format!("--user-data-dir={}", dir.join("profile").display()))
        .arg("--dump-dom")
        .arg(file_url(&html))
        .env("HOME", &dir)
        .env("XDG_CONFIG_HOME", dir.join("config"))
        .env("XDG_CACHE_HOME", dir.join("cache"))
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&out)?)
        .stderr(std::fs::File::create(&err)?)
        .process_group(0)
        .spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(std::io::Error::new(
                e.kind(),
                format!(
                    "run {}: {e} (run scripts/deps: Debian package chromium)",
                    program.to_string_lossy()
                ),
            ));
        }
    };
    // Wall time on purpose: the deadline stops a hung browser.
    let deadline = std::time::Instant::now() + HEADLESS_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if std::time::Instant::now() < deadline => std::thread::sleep(WAIT_POLL),
            Ok(None) => {
                // The group's id is the child's PID (process_group(0)): this ends the
                // browser and the helper processes it forked, nothing else.
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", "--", &format!("-{}", child.id())])
                    .status();
                let _ = child.kill();
                let _ = child.wait();
                break Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("chromium still running after {HEADLESS_TIMEOUT:?}; killed"),
                ));
            }
            Err(e) => break Err(e),
        }
    };
    let dom = std::fs::read_to_string(&out);
    let said = std::fs::read_to_string(&err).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    let status = status.map_err(|e| std::io::Error::new(e.kind(), format!("{e}\n{said}")))?;
    let dom = dom?;
    if !status.success() || dom.trim().is_empty() {
        return Err(std::io::Error::other(format!(
            "chromium --dump-dom {}: {status}, {} bytes of DOM\n--- stderr\n{said}",
            html.display(),
            dom.len()
        )));
    }
    Ok(dom)
}

/// The `file://` URL of the absolute path `path`, bytes other than unreserved ones and `/`
/// percent-encoded.
fn file_url(path: &std::path::Path) -> String {
    use std::os::unix::ffi::OsStrExt as _;
    let mut url = String::from("file://");
    for &b in path.as_os_str().as_bytes() {
        if b.is_ascii_alphanumeric() || b"/-._~".contains(&b) {
            url.push(char::from(b));
        } else {
            url.push_str(&format!("%{b:02X}"));
        }
    }
    url
}
