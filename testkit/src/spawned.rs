//! [`Spawned`]: a provider or broker run as a real process on 127.0.0.1 port 0, its RPC
//! and metrics addresses read from the listening line it prints, its metrics scraped over
//! HTTP and its CPU time and memory read from `/proc/PID`, and whether an echo call through
//! it succeeds; and [`budgeted_broker`], the broker with a memory budget that the hostile
//! tests of both tiers flood.

use std::io::BufRead;
use std::net::SocketAddr;
use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use rpcmesh_common::cli::startup::parse_listening_line;
use rpcmesh_common::metrics::recorder::sample;
use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_wire::Status;

use crate::child::ChildGuard;
use crate::in_process::echo_call;
use crate::paths::{bin_path, example_path};
use crate::wait::{WAIT_TIMEOUT, wait_for};

/// The kernel's `USER_HZ`, the unit of `/proc/PID/stat`'s CPU times (100 on every Linux
/// build this runs on).
const CLOCK_TICKS_PER_SECOND: f64 = 100.0;

/// The memory budget of [`budgeted_broker`]'s broker, MiB: far below what the hostile tests
/// send it, far above what it needs for their small calls.
pub const BROKER_BUDGET_MIB: usize = 64;

/// How a [`Spawned`] program is started beyond its flags.
#[derive(Debug, Default, Clone, Copy)]
pub struct Launch<'a> {
    /// Variables set in its environment (on top of the test's).
    pub env: &'a [(&'a str, &'a str)],
    /// Where its stderr goes (`None`: discarded).
    pub stderr: Option<&'a Path>,
    /// A descriptor of the test's its stderr is instead (the child gets a copy), such as
    /// the write end of a pipe from [`crate::stderr`]; before [`Launch::stderr`].
    pub stderr_fd: Option<BorrowedFd<'a>>,
}

/// A provider or broker run as a real process, killed by PID when dropped.
#[derive(Debug)]
pub struct Spawned {
    /// The process.
    pub child: ChildGuard,
    /// Where it takes calls.
    pub rpc: SocketAddr,
    /// Where it serves `/metrics`, unless started with `--metrics-listen off`.
    pub metrics: Option<SocketAddr>,
}

impl Spawned {
    /// Starts workspace binary `name` listening on 127.0.0.1 port 0 for calls and for
    /// metrics, with `args` after, and waits for its listening line. Its later output on
    /// stdout is read and dropped, its stderr discarded.
    pub fn start(name: &str, args: &[&str]) -> Spawned {
        Spawned::start_with(name, args, Launch::default())
    }

    /// As [`Spawned::start`], started as `launch` says.
    pub fn start_with(name: &str, args: &[&str], launch: Launch<'_>) -> Spawned {
        Spawned::spawn(name, "127.0.0.1:0", args, launch)
    }

    /// As [`Spawned::start`], taking calls on `listen` (an address of the test's, e.g. from
    /// [`crate::free_port`]), so that the program can be stopped and started again on the
    /// same address, as a supervisor restarts it.
    pub fn start_at(name: &str, listen: SocketAddr, args: &[&str]) -> Spawned {
        Spawned::spawn(name, &listen.to_string(), args, Launch::default())
    }

    /// As [`Spawned::start`], for example `name` of workspace package `package` (one that
    /// takes the broker's flags: `rpcmesh-broker`'s yardsticks).
    pub fn start_example(package: &str, name: &str, args: &[&str]) -> Spawned {
        let path = example_path(package, name);
        Spawned::spawn_path(&path, name, "127.0.0.1:0", args, Launch::default())
    }

    fn spawn(name: &str, listen: &str, args: &[&str], launch: Launch<'_>) -> Spawned {
        Spawned::spawn_path(&bin_path(name), name, listen, args, launch)
    }

    fn spawn_path(
        path: &Path,
        name: &str,
        listen: &str,
        args: &[&str],
        launch: Launch<'_>,
    ) -> Spawned {
        let err = match (launch.stderr_fd, launch.stderr) {
            (Some(fd), _) => fd
                .try_clone_to_owned()
                .map(std::process::Stdio::from)
                .expect("copy the stderr descriptor"),
            (None, Some(path)) => std::fs::File::create(path)
                .map(std::process::Stdio::from)
                .expect("create the stderr file"),
            (None, None) => std::process::Stdio::null(),
        };
        let mut child = std::process::Command::new(path)
            .envs(launch.env.iter().copied())
            .args(["--listen", listen, "--metrics-listen", "127.0.0.1:0"])
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let child = ChildGuard(Some(child));
        // Read on a thread of its own, so that a program that hangs before it listens fails
        // the test (after the hang detector's wait) instead of stalling it.
        let (found, listening) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = std::io::BufReader::new(stdout).lines();
            let addrs = lines
                .by_ref()
                .map_while(Result::ok)
                .find_map(|l| parse_listening_line(&l));
            let _ = found.send(addrs);
            lines.for_each(drop);
        });
        let (rpc, metrics) = match listening.recv_timeout(WAIT_TIMEOUT) {
            Ok(Some(addrs)) => addrs,
            Ok(None) => panic!("{name} printed no listening line"),
            Err(_) => panic!("{name} printed no listening line within {WAIT_TIMEOUT:?}"),
        };
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

    /// Its `/metrics` text now (empty when nothing answers, or answers with an error).
    pub fn scrape(&self) -> String {
        self.metrics
            .and_then(|addr| crate::http::get(addr, "/metrics").ok())
            .unwrap_or_default()
    }

    /// The value of a metric (summed over the matching series; 0 when there is none).
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        sample(&self.scrape(), name, labels).unwrap_or(0.0)
    }

    /// A line of `/proc/PID/status` (`VmRSS`, `VmSize`...), in KiB.
    pub fn status_kib(&self, field: &str) -> u64 {
        proc_status_kib(self.pid(), field)
            .unwrap_or_else(|| panic!("{field} in /proc/PID/status of a running process"))
    }

    /// Samples its resident memory until [`PeakRss::stop`], keeping the highest.
    pub fn watch_rss(&self) -> PeakRss {
        PeakRss::watch(self.pid())
    }

    /// True when one echo call on a fresh connection to it succeeds.
    pub async fn call_succeeds(&self) -> bool {
        let Ok(c) = Client::connect(self.rpc, ClientConfig::default()).await else {
            return false;
        };
        matches!(
            echo_call(&c, "let me in").await,
            Ok(Ok(r)) if r.status == Status::Success
        )
    }

    /// Waits until a call through it succeeds (a broker's pool is made in the background).
    pub async fn wait_serving(&self) {
        wait_for("a call succeeds", || async {
            self.call_succeeds().await.then_some(())
        })
        .await;
    }
}

/// A field of `/proc/PID/status` in KiB (`None`: the process is gone, or has no such
/// field).
fn proc_status_kib(pid: u32, field: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A process's highest resident memory, sampled every few milliseconds on a thread of
/// its own until [`PeakRss::stop`].
#[derive(Debug)]
pub struct PeakRss {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// How often [`PeakRss`] samples: often enough to catch a flood's peak, a read of a small
/// file each time.
const RSS_SAMPLE_EVERY: Duration = Duration::from_millis(5);

impl PeakRss {
    fn watch(pid: u32) -> PeakRss {
        let (peak, stop) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let (p, s) = (peak.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Some(kib) = proc_status_kib(pid, "VmRSS") {
                    p.fetch_max(kib, Ordering::Relaxed);
                }
                std::thread::sleep(RSS_SAMPLE_EVERY);
            }
        });
        PeakRss {
            peak,
            stop,
            thread: Some(thread),
        }
    }

    /// Stops sampling; the highest resident memory seen, KiB.
    pub fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.peak.load(Ordering::Relaxed)
    }
}

impl Drop for PeakRss {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A provider, and a broker in front of it with a budget of [`BROKER_BUDGET_MIB`], serving.
pub async fn budgeted_broker() -> (Spawned, Spawned) {
    budgeted_broker_with(BROKER_BUDGET_MIB, &[]).await
}

/// As [`budgeted_broker`], with a budget of `budget_mib` and the broker's flags `extra`.
pub async fn budgeted_broker_with(budget_mib: usize, extra: &[&str]) -> (Spawned, Spawned) {
    let provider = Spawned::start("provider", &["--threads", "1"]);
    let upstream = provider.rpc.to_string();
    let budget = format!("{budget_mib}MiB");
    // One malloc arena: glibc reserves 64 MiB of address space for each thread's own
    // arena, the first time a thread allocates. The broker's blocking threads (metrics,
    // system readings) are made when first needed, so that reservation could fall on
    // either side of the measurement (seen: +64 MiB of address space, +0 of RSS). The
    // tests are about what the broker reserves for what it is sent.
    let mut args = vec![
        "--threads",
        "1",
        "--memory-budget",
        &budget,
        "--upstream",
        &upstream,
    ];
    args.extend_from_slice(extra);
    let broker = Spawned::start_with(
        "broker",
        &args,
        Launch {
            env: &[("MALLOC_ARENA_MAX", "1")],
            ..Launch::default()
        },
    );
    broker.wait_serving().await;
    (provider, broker)
}
