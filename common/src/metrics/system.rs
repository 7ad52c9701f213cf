//! System metrics of one program instance, read from `/proc`: per CPU, the count of every
//! softirq vector (`/proc/softirqs`) and the time spent in each mode (`/proc/stat`); and
//! the process's own CPU time, memory, file descriptors and threads (`/proc/self`).
//!
//! Owns the parsing of `/proc/softirqs` ([`parse_softirqs`], pure: no crate parses it), the
//! numbering of the CPUs of `/proc/stat` ([`parse_stat`]), the handles of the metrics
//! below, and the task that refreshes them ([`spawn`]). Leaves their names, labels and help
//! to the catalogue ([`crate::metrics::catalogue`]); the recorder, its rendering and the
//! `/metrics` endpoint to [`crate::metrics::recorder`]; the parsing of `/proc/stat` to
//! `procfs` and of `/proc/self` to `metrics-process`; and when to start and stop collecting
//! to each program's `run`.
//!
//! # Metrics
//!
//! | name | type | labels |
//! |---|---|---|
//! | `rpcmesh_softirqs_total` | counter | `role`, `cpu`, `vector` |
//! | `rpcmesh_cpu_seconds_total` | counter | `role`, `cpu`, `mode` |
//! | `rpcmesh_host_cpu_seconds` | histogram | `role`, `mode` |
//! | `rpcmesh_process_cpu_seconds_total` | counter | `role` |
//! | `rpcmesh_process_cpu_seconds` | histogram | `role` |
//! | `rpcmesh_process_resident_memory_bytes`, `rpcmesh_process_virtual_memory_bytes`, `rpcmesh_process_virtual_memory_max_bytes` | gauge | `role` |
//! | `rpcmesh_process_open_fds`, `rpcmesh_process_max_fds`, `rpcmesh_process_threads`, `rpcmesh_process_start_time_seconds` | gauge | `role` |
//!
//! `cpu` is the kernel's CPU number (`"0"`, `"1"`, …, the same in both files, so the two
//! can be joined); `vector` is the row name of `/proc/softirqs` lower-cased (`net_rx`,
//! `timer`, …); `mode` is one of `user`, `nice`, `system`, `idle`, `iowait`, `irq`,
//! `softirq`, `steal` (a mode the kernel does not report is left out). `guest` and
//! `guest_nice` are left out on purpose: the kernel already counts them inside `user` and
//! `nice`, and without them the modes of a CPU add up to its whole time. So the series stay
//! bounded by CPUs × vectors (at most [`MAX_VECTORS`]) and CPUs × 8; no label carries a
//! PID, a port or anything a peer chooses. The share of CPU time spent in softirqs is
//!
//! ```promql
//! sum by (instance) (rate(rpcmesh_cpu_seconds_total{mode="softirq"}[5m]))
//!   / sum by (instance) (rate(rpcmesh_cpu_seconds_total[5m]))
//! ```
//!
//! # CPU seconds are counted in whole seconds
//!
//! Prometheus values are floats, and `node_exporter` exports CPU time as a fractional
//! counter. Here that cannot be had: `metrics::Counter` holds a `u64`, and
//! `metrics-exporter-prometheus` renders an `f64` only as a `Gauge`, typed `gauge`.
//! `promtool check metrics` rejects the two ways around it: a gauge named `…_total`
//! ("non-counter metrics should not have "_total" suffix"), and a counter in a smaller unit
//! ("use base unit "seconds" instead of "milliseconds"").
//!
//! So `rpcmesh_cpu_seconds_total` and `rpcmesh_process_cpu_seconds_total` are counters of
//! whole seconds, rounded down (ticks ÷ `USER_HZ`). Their name, type and unit are what
//! PromQL and promtool expect, `rate()` and its reset handling work on them, and
//! `Counter::absolute` keeps the larger of the old and new value, so an `iowait` that the
//! kernel moves backwards (proc(5) warns it can) holds still instead of looking like a
//! reset. The cost is resolution: a rate over `[1m]` of one series is within ±1/60 of a
//! CPU, and the softirq share above over `N` CPUs is within about ±0.7/√N percentage points
//! (one standard deviation) over `[1m]`, five times less over `[5m]`; use `[5m]` or longer
//! for small shares. A fractional gauge under another name (`rpcmesh_cpu_seconds`) would
//! be exact but typed wrongly for `rate()`; we keep the right name and type because they
//! are the interface that queries are written against: once [`crate::metrics::recorder`] can render
//! float counters, these become exact without any query changing.
//!
//! `/proc/softirqs` prints each count as a 32-bit unsigned int that wraps (in about 12 h
//! at 100 000 `NET_RX` per second on one CPU). Each series therefore keeps its own 64-bit
//! total, advanced by the growth since the previous reading modulo 2³², so the exported
//! counter neither wraps nor sticks.
//!
//! # Fractional process CPU time
//!
//! For CPU per call the whole seconds of the process counter are too coarse, so the same
//! time is also exported exactly as the histogram `rpcmesh_process_cpu_seconds`: each
//! collection observes the CPU time used since the previous one (the first, the time used
//! since the process started). Its `_sum` is therefore the process's CPU time in
//! fractional seconds, a float that only grows: `rate(rpcmesh_process_cpu_seconds_sum[1m])`
//! is the CPU the process uses, in cores. (A histogram's `_sum` is the one float counter
//! the exporter renders.) Its buckets say little: collections come every 5 s and at every
//! scrape, so their intervals vary.
//!
//! The host's time in each mode, summed over its CPUs, is exported exactly the same way:
//! `rpcmesh_host_cpu_seconds{mode}`, one observation per collection (the first reading
//! only sets the start), so its `_sum` is a fractional counter and the softirq share over any window is
//! `rate(rpcmesh_host_cpu_seconds_sum{mode="softirq"}[1m]) / ignoring(mode)
//! sum without(mode) (rate(rpcmesh_host_cpu_seconds_sum[1m]))`.
//!
//! Every figure here is also read afresh at each scrape of `/metrics` (see
//! [`crate::metrics::endpoint`]), so two scrapes bound exactly the time between them.
//!
//! # Process metrics
//!
//! The figures come from `metrics_process::collector::collect()`, the crate's plain
//! snapshot, rather than from its `Collector`, which records through the global `metrics`
//! macros: that way they carry `role` like every other rpcmesh metric and their handles
//! are registered once. The names are the crate's (the standard Prometheus process
//! metrics) with the `rpcmesh_` prefix, and so are the types; its `Collector` also rounds
//! the CPU time down to a `u64` counter.
//!
//! # Errors
//!
//! A source (`/proc/softirqs`, `/proc/stat`, `/proc/self`) that cannot be read or parsed is
//! logged at warn the first time and at debug after that; its metrics keep their last
//! values, the other sources still update, and nothing else counts the failure.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{Counter, Gauge};
use procfs::{CpuTime, FromReadSI, KernelStats};

use crate::metrics::Telemetry;
use crate::metrics::catalogue::{
    CPU_SECONDS_TOTAL, Family, HOST_CPU_SECONDS, PROCESS_CONTEXT_SWITCHES_TOTAL,
    PROCESS_CPU_SECONDS, PROCESS_CPU_SECONDS_TOTAL, PROCESS_MAX_FDS, PROCESS_OPEN_FDS,
    PROCESS_RESIDENT_MEMORY_BYTES, PROCESS_START_TIME_SECONDS, PROCESS_THREADS,
    PROCESS_VIRTUAL_MEMORY_BYTES, PROCESS_VIRTUAL_MEMORY_MAX_BYTES, Role, SOFTIRQS_TOTAL,
};
use crate::net::shutdown::CancellationToken;

/// How often [`spawn`] reads `/proc` unless told otherwise: a third of Prometheus's usual
/// 15 s scrape interval, so a scrape sees figures at most 5 s old. One collection reads a
/// handful of small `/proc` files (well under a millisecond), so this costs nothing
/// measurable.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);

/// The shortest interval [`spawn`] uses (shorter ones are raised to it): CPU time moves in
/// whole seconds here and scrapes come seconds apart, so reading more often only costs CPU;
/// it also makes a zero interval, on which Tokio would panic, harmless.
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// The most softirq vectors given series; rows beyond it are ignored. The kernel has had
/// ten (`NR_SOFTIRQS`) since 2.6.32; 32 leaves room for new ones while keeping the series
/// bounded should the file ever hold something else.
pub const MAX_VECTORS: usize = 32;

const SOFTIRQS_PATH: &str = "/proc/softirqs";
const STAT_PATH: &str = "/proc/stat";

/// The process gauges.
const PROCESS_GAUGES: usize = 7;

/// Each process gauge with its value in a `metrics-process` snapshot (the order is that of
/// [`SystemMetrics`]'s handles).
fn process_gauges(
    m: &metrics_process::collector::Metrics,
) -> [(&'static Family, Option<u64>); PROCESS_GAUGES] {
    [
        (&PROCESS_RESIDENT_MEMORY_BYTES, m.resident_memory_bytes),
        (&PROCESS_VIRTUAL_MEMORY_BYTES, m.virtual_memory_bytes),
        (
            &PROCESS_VIRTUAL_MEMORY_MAX_BYTES,
            m.virtual_memory_max_bytes,
        ),
        (&PROCESS_OPEN_FDS, m.open_fds),
        (&PROCESS_MAX_FDS, m.max_fds),
        (&PROCESS_THREADS, m.threads),
        (&PROCESS_START_TIME_SECONDS, m.start_time_seconds),
    ]
}

/// This process's voluntary and involuntary context switches, summed over its threads
/// (`/proc/self/task/*/status`); zeros where nothing can be read.
fn context_switches() -> [u64; 2] {
    let mut counts = [0u64; 2];
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return counts;
    };
    for task in tasks.flatten() {
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
            continue;
        };
        for line in status.lines() {
            let (i, rest) = if let Some(r) = line.strip_prefix("voluntary_ctxt_switches:") {
                (0, r)
            } else if let Some(r) = line.strip_prefix("nonvoluntary_ctxt_switches:") {
                (1, r)
            } else {
                continue;
            };
            counts[i] += rest.trim().parse::<u64>().unwrap_or(0);
        }
    }
    counts
}

/// Why a source of system metrics could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SysError {
    /// A `/proc` file could not be read: not Linux, `/proc` not mounted, or not permitted.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: &'static str,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// `/proc/softirqs` is empty.
    #[error("/proc/softirqs: no header line naming the CPUs")]
    NoHeader,
    /// A column of the `/proc/softirqs` header is not `CPU<n>`, or names a CPU twice.
    #[error("/proc/softirqs line {line}: {token:?} is not a new CPU column (CPU<n>)")]
    BadHeader {
        /// 1-based line number.
        line: usize,
        /// The column.
        token: String,
    },
    /// A `/proc/softirqs` line is not `NAME: count count …`.
    #[error("/proc/softirqs line {line}: not a `NAME: counts` row")]
    BadRow {
        /// 1-based line number.
        line: usize,
    },
    /// A `/proc/softirqs` count is not a non-negative decimal integer that fits 64 bits.
    #[error("/proc/softirqs line {line}: {token:?} is not a count")]
    BadCount {
        /// 1-based line number.
        line: usize,
        /// The token.
        token: String,
    },
    /// A `/proc/softirqs` row has more counts than the header has CPUs.
    #[error("/proc/softirqs line {line}: {counts} counts for {cpus} CPUs")]
    TooManyCounts {
        /// 1-based line number.
        line: usize,
        /// Counts on the row.
        counts: usize,
        /// CPUs in the header.
        cpus: usize,
    },
    /// A `/proc/softirqs` vector appears on two rows.
    #[error("/proc/softirqs line {line}: vector {vector} appears twice")]
    DuplicateVector {
        /// 1-based line number of the second row.
        line: usize,
        /// The vector, lower-cased.
        vector: String,
    },
    /// `procfs` could not parse `/proc/stat`.
    #[error("/proc/stat: {0}")]
    Stat(#[source] procfs::ProcError),
    /// A per-CPU line of `/proc/stat` does not start with `cpu<n>`.
    #[error("/proc/stat: {name:?} does not name a CPU")]
    StatCpu {
        /// The line's first word.
        name: String,
    },
    /// `metrics-process` got nothing from `/proc/self/stat`.
    #[error("cannot read this process's figures from /proc/self/stat")]
    Process,
}

/// The contents of `/proc/softirqs`: for each vector, its count on each CPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Softirqs {
    /// The CPU number of each column, in column order, as the header names it (`CPU3` → 3).
    pub cpus: Vec<u32>,
    /// One row per vector, in file order.
    pub rows: Vec<SoftirqRow>,
}

/// One row of `/proc/softirqs`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SoftirqRow {
    /// The vector, lower-cased as the kernel writes it upper-cased (`NET_RX` → `net_rx`).
    pub vector: String,
    /// The count on each CPU, in the header's column order; shorter than
    /// [`Softirqs::cpus`] when the row stops early.
    pub counts: Vec<u64>,
}

/// Parses the text of `/proc/softirqs`: a header of `CPU<n>` columns, then one
/// `NAME: count …` row per vector. Any whitespace separates columns, blank lines are
/// skipped, a row may stop before the last CPU, and rows of any name are kept.
pub fn parse_softirqs(text: &str) -> Result<Softirqs, SysError> {
    let mut lines = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l))
        .filter(|(_, l)| !l.trim().is_empty());

    let (header_line, header) = lines.next().ok_or(SysError::NoHeader)?;
    let mut cpus = Vec::new();
    let mut seen = HashSet::new();
    for token in header.split_whitespace() {
        let cpu = token
            .strip_prefix("CPU")
            .and_then(decimal)
            .and_then(|n| u32::try_from(n).ok())
            .filter(|&n| seen.insert(n))
            .ok_or_else(|| SysError::BadHeader {
                line: header_line,
                token: token.to_owned(),
            })?;
        cpus.push(cpu);
    }

    let mut rows: Vec<SoftirqRow> = Vec::new();
    for (line, text) in lines {
        let (name, counts) = text.split_once(':').ok_or(SysError::BadRow { line })?;
        let vector = name.trim().to_ascii_lowercase();
        if vector.is_empty() {
            return Err(SysError::BadRow { line });
        }
        let counts = counts
            .split_whitespace()
            .map(|t| {
                decimal(t).ok_or_else(|| SysError::BadCount {
                    line,
                    token: t.to_owned(),
                })
            })
            .collect::<Result<Vec<u64>, SysError>>()?;
        if counts.len() > cpus.len() {
            return Err(SysError::TooManyCounts {
                line,
                counts: counts.len(),
                cpus: cpus.len(),
            });
        }
        if rows.iter().any(|r| r.vector == vector) {
            return Err(SysError::DuplicateVector { line, vector });
        }
        rows.push(SoftirqRow { vector, counts });
    }
    Ok(Softirqs { cpus, rows })
}

/// The time of each CPU from the text of `/proc/stat`, parsed by `procfs`, with the CPU's
/// number from its `cpu<n>` line: `procfs` keeps only the order, and `/proc/stat` lists
/// online CPUs only, so once one is offline (say, SMT switched off) the position is no
/// longer the number.
pub fn parse_stat(text: &str) -> Result<Vec<(u32, CpuTime)>, SysError> {
    let stats = KernelStats::from_read(text.as_bytes(), procfs::current_system_info())
        .map_err(SysError::Stat)?;
    // The same test procfs applies to pick per-CPU lines, so the two lists line up.
    let ids = text
        .lines()
        .filter(|l| l.starts_with("cpu") && !l.starts_with("cpu "))
        .map(|l| {
            let name = l.split_whitespace().next().unwrap_or_default();
            name.strip_prefix("cpu")
                .and_then(decimal)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| SysError::StatCpu {
                    name: name.to_owned(),
                })
        })
        .collect::<Result<Vec<u32>, SysError>>()?;
    if ids.len() != stats.cpu_time.len() {
        return Err(SysError::StatCpu {
            name: format!("{} cpu lines for {} CPUs", ids.len(), stats.cpu_time.len()),
        });
    }
    Ok(ids.into_iter().zip(stats.cpu_time).collect())
}

/// A non-negative decimal integer: digits only (no sign, no spaces), fitting 64 bits.
fn decimal(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// How much a `/proc/softirqs` count grew from `last` to `now`. The kernel prints these as
/// 32-bit unsigned ints, so a drop from a value that fits 32 bits is a wrap; a drop from a
/// larger one (a kernel with wider counts) can only be a restart from zero.
fn growth(last: u64, now: u64) -> u64 {
    const WRAP: u64 = 1 << 32;
    if now >= last {
        now - last
    } else if last < WRAP {
        WRAP - last + now
    } else {
        now
    }
}

/// The host's CPU time now, seconds summed over its CPUs: `(softirq, every mode)`, with
/// the modes counted as the `mode` label counts them (guest time inside user and nice).
/// `None` when `/proc/stat` cannot be read. For a program that wants the figure without a
/// recorder (the driver's own reading in `driver capacity`).
pub fn host_cpu_seconds() -> Option<(f64, f64)> {
    let cpus = read(STAT_PATH).and_then(|t| parse_stat(&t)).ok()?;
    let tps = procfs::ticks_per_second().max(1) as f64;
    let mode_ticks =
        |mode: CpuMode| -> u64 { cpus.iter().filter_map(|(_, t)| mode.ticks(t)).sum() };
    let all: u64 = CpuMode::ALL.iter().map(|&m| mode_ticks(m)).sum();
    Some((mode_ticks(CpuMode::Softirq) as f64 / tps, all as f64 / tps))
}

/// A CPU mode of `/proc/stat`, the `mode` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CpuMode {
    User,
    Nice,
    System,
    Idle,
    Iowait,
    Irq,
    Softirq,
    Steal,
}

impl CpuMode {
    const ALL: [CpuMode; 8] = [
        CpuMode::User,
        CpuMode::Nice,
        CpuMode::System,
        CpuMode::Idle,
        CpuMode::Iowait,
        CpuMode::Irq,
        CpuMode::Softirq,
        CpuMode::Steal,
    ];

    fn label(self) -> &'static str {
        match self {
            CpuMode::User => "user",
            CpuMode::Nice => "nice",
            CpuMode::System => "system",
            CpuMode::Idle => "idle",
            CpuMode::Iowait => "iowait",
            CpuMode::Irq => "irq",
            CpuMode::Softirq => "softirq",
            CpuMode::Steal => "steal",
        }
    }

    /// The ticks of this mode, if the kernel reports it.
    fn ticks(self, t: &CpuTime) -> Option<u64> {
        match self {
            CpuMode::User => Some(t.user),
            CpuMode::Nice => Some(t.nice),
            CpuMode::System => Some(t.system),
            CpuMode::Idle => Some(t.idle),
            CpuMode::Iowait => t.iowait,
            CpuMode::Irq => t.irq,
            CpuMode::Softirq => t.softirq,
            CpuMode::Steal => t.steal,
        }
    }
}

/// One `rpcmesh_softirqs_total` series: its handle, the kernel's last (32-bit) count and
/// our running total.
#[derive(Debug)]
struct SoftirqSeries {
    counter: Counter,
    last: u64,
    total: u64,
}

impl SoftirqSeries {
    fn new(counter: Counter, count: u64) -> Self {
        SoftirqSeries {
            counter,
            last: count,
            total: count,
        }
    }

    fn update(&mut self, count: u64) {
        self.total = self.total.saturating_add(growth(self.last, count));
        self.last = count;
        self.counter.absolute(self.total);
    }
}

/// Whether each source has already logged a failure at warn.
#[derive(Debug, Default)]
struct Warned {
    softirqs: bool,
    stat: bool,
    process: bool,
    vectors: bool,
}

/// Reads `/proc` and updates the system metrics of one program instance.
#[derive(Debug)]
pub struct SystemMetrics {
    telemetry: Telemetry,
    role: Role,
    ticks_per_second: u64,
    /// vector → CPU → series, registered the first time the pair is seen.
    softirqs: HashMap<String, HashMap<u32, SoftirqSeries>>,
    /// CPU → one counter per [`CpuMode::ALL`], registered the first time it is seen.
    cpu_seconds: HashMap<u32, [Option<Counter>; CpuMode::ALL.len()]>,
    /// One histogram per [`CpuMode::ALL`] of the host's time in it, and its last total.
    host_cpu: [Option<(metrics::Histogram, u64)>; CpuMode::ALL.len()],
    process_cpu: Option<Counter>,
    process_cpu_exact: Option<(metrics::Histogram, f64)>,
    process_gauges: [Option<Gauge>; PROCESS_GAUGES],
    /// Voluntary and involuntary context switches: the counter and its highest total.
    context_switches: [Option<(Counter, u64)>; 2],
    warned: Warned,
}

impl SystemMetrics {
    /// The metrics of a program of `role`; the series are registered by [`Self::collect`]
    /// as it first sees them (their help comes from the catalogue, like every other's).
    pub fn new(telemetry: &Telemetry, role: Role) -> Self {
        SystemMetrics {
            telemetry: telemetry.clone(),
            role,
            // sysconf(_SC_CLK_TCK) is 100 on every Linux we run on; max(1) only guards the
            // division.
            ticks_per_second: procfs::ticks_per_second().max(1),
            softirqs: HashMap::new(),
            cpu_seconds: HashMap::new(),
            host_cpu: Default::default(),
            process_cpu: None,
            process_cpu_exact: None,
            process_gauges: Default::default(),
            context_switches: Default::default(),
            warned: Warned::default(),
        }
    }

    /// Reads /proc/softirqs, /proc/stat and the process's own figures once and updates the
    /// handles. Never panics; a read error is logged once (tracing::warn) and counted
    /// nowhere else.
    pub fn collect(&mut self) {
        match read(SOFTIRQS_PATH).and_then(|t| parse_softirqs(&t)) {
            Ok(s) => self.record_softirqs(&s),
            Err(e) => warn_once(&mut self.warned.softirqs, self.role, &e),
        }
        match read(STAT_PATH).and_then(|t| parse_stat(&t)) {
            Ok(cpus) => self.record_stat(&cpus),
            Err(e) => warn_once(&mut self.warned.stat, self.role, &e),
        }
        self.record_context_switches(&context_switches());
        let process = metrics_process::collector::collect();
        if process.cpu_seconds_total.is_none() {
            warn_once(&mut self.warned.process, self.role, &SysError::Process);
        }
        self.record_process(&process);
    }

    fn record_softirqs(&mut self, s: &Softirqs) {
        let (telemetry, role) = (&self.telemetry, self.role);
        for row in &s.rows {
            if !self.softirqs.contains_key(row.vector.as_str()) {
                if self.softirqs.len() >= MAX_VECTORS {
                    if !std::mem::replace(&mut self.warned.vectors, true) {
                        tracing::warn!(
                            role = role.label(),
                            vector = %row.vector,
                            max = MAX_VECTORS,
                            "too many softirq vectors; ignoring the rest"
                        );
                    }
                    continue;
                }
                self.softirqs.insert(row.vector.clone(), HashMap::new());
            }
            let Some(per_cpu) = self.softirqs.get_mut(row.vector.as_str()) else {
                continue;
            };
            for (&cpu, &count) in s.cpus.iter().zip(&row.counts) {
                per_cpu
                    .entry(cpu)
                    .or_insert_with(|| {
                        let counter = telemetry.counter(
                            &SOFTIRQS_TOTAL,
                            &[
                                ("role", role.label()),
                                ("cpu", &cpu.to_string()),
                                ("vector", &row.vector),
                            ],
                        );
                        SoftirqSeries::new(counter, count)
                    })
                    .update(count);
            }
        }
    }

    fn record_stat(&mut self, cpus: &[(u32, CpuTime)]) {
        let (telemetry, role) = (&self.telemetry, self.role);
        for (mode, slot) in CpuMode::ALL.iter().zip(self.host_cpu.iter_mut()) {
            let ticks: Option<u64> = cpus.iter().map(|(_, t)| mode.ticks(t)).sum();
            let Some(ticks) = ticks else { continue };
            // The first reading only sets the start: the time since boot is no one's.
            let (hist, last) = slot.get_or_insert_with(|| {
                let h = telemetry.histogram(
                    &HOST_CPU_SECONDS,
                    &[("role", role.label()), ("mode", mode.label())],
                );
                (h, ticks)
            });
            // A count the kernel moved backwards (iowait) waits until it is passed again.
            if ticks > *last {
                hist.record((ticks - *last) as f64 / self.ticks_per_second as f64);
                *last = ticks;
            }
        }
        for (cpu, time) in cpus {
            let handles = self.cpu_seconds.entry(*cpu).or_default();
            for (mode, handle) in CpuMode::ALL.iter().zip(handles.iter_mut()) {
                let Some(ticks) = mode.ticks(time) else {
                    continue;
                };
                handle
                    .get_or_insert_with(|| {
                        telemetry.counter(
                            &CPU_SECONDS_TOTAL,
                            &[
                                ("role", role.label()),
                                ("cpu", &cpu.to_string()),
                                ("mode", mode.label()),
                            ],
                        )
                    })
                    .absolute(ticks / self.ticks_per_second);
            }
        }
    }

    /// Sets `rpcmesh_process_context_switches_total` from the threads' counts (summed over
    /// the threads alive now; a total never goes back, though a thread that ended takes
    /// its count with it).
    fn record_context_switches(&mut self, counts: &[u64; 2]) {
        let (telemetry, role) = (&self.telemetry, self.role);
        for ((kind, &count), slot) in ["voluntary", "involuntary"]
            .iter()
            .zip(counts)
            .zip(self.context_switches.iter_mut())
        {
            let (counter, total) = slot.get_or_insert_with(|| {
                let c = telemetry.counter(
                    &PROCESS_CONTEXT_SWITCHES_TOTAL,
                    &[("role", role.label()), ("kind", kind)],
                );
                (c, 0)
            });
            *total = (*total).max(count);
            counter.absolute(*total);
        }
    }

    fn record_process(&mut self, m: &metrics_process::collector::Metrics) {
        let (telemetry, role) = (&self.telemetry, self.role);
        if let Some(seconds) = m.cpu_seconds_total {
            self.process_cpu
                .get_or_insert_with(|| {
                    telemetry.counter(&PROCESS_CPU_SECONDS_TOTAL, &[("role", role.label())])
                })
                // Rounds down; NaN or a negative value (never seen) becomes 0.
                .absolute(seconds as u64);
            let (hist, last) = self.process_cpu_exact.get_or_insert_with(|| {
                (
                    telemetry.histogram(&PROCESS_CPU_SECONDS, &[("role", role.label())]),
                    0.0,
                )
            });
            if seconds.is_finite() && seconds > *last {
                hist.record(seconds - *last);
                *last = seconds;
            }
        }
        for ((family, value), handle) in process_gauges(m)
            .into_iter()
            .zip(self.process_gauges.iter_mut())
        {
            if let Some(v) = value {
                handle
                    .get_or_insert_with(|| telemetry.gauge(family, &[("role", role.label())]))
                    .set(v as f64);
            }
        }
    }
}

/// Collects every `interval` (at least [`MIN_INTERVAL`]), the first time at once, and at
/// every scrape of the telemetry's endpoint, until `stop` is cancelled, and once more then. The reads run on Tokio's blocking pool: they are file I/O, and
/// listing `/proc/self/fd` takes a while when thousands of connections are open.
pub fn spawn(
    telemetry: Telemetry,
    role: Role,
    interval: Duration,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if !telemetry.is_recording() {
            return;
        }
        let metrics = Arc::new(Mutex::new(SystemMetrics::new(&telemetry, role)));
        // Each scrape reads /proc first, so that its figures are current (see
        // crate::metrics::endpoint). Weak: the hook must not keep the metrics (and through
        // them the recorder) alive after this task ends.
        let weak = Arc::downgrade(&metrics);
        telemetry.on_scrape(Arc::new(move || {
            if let Some(m) = weak.upgrade() {
                m.lock().unwrap_or_else(|e| e.into_inner()).collect();
            }
        }));
        let mut ticker = tokio::time::interval(interval.max(MIN_INTERVAL));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let last = tokio::select! {
                () = stop.cancelled() => true,
                _ = ticker.tick() => false,
            };
            let m = metrics.clone();
            let collected = tokio::task::spawn_blocking(move || {
                m.lock().unwrap_or_else(|e| e.into_inner()).collect();
            })
            .await;
            match collected {
                // A last reading on the way out, so the final figures include the end.
                Ok(()) if last => return,
                Ok(()) => {}
                Err(e) if e.is_panic() => {
                    tracing::warn!(role = role.label(), error = %e, "system metrics collection panicked; stopped");
                    return;
                }
                Err(e) => {
                    tracing::debug!(role = role.label(), error = %e, "system metrics collection cancelled");
                    return;
                }
            }
        }
    })
}

/// The background work of a program's telemetry: draining histogram samples
/// ([`Telemetry::spawn_upkeep`]) and collecting the system metrics ([`spawn`]). Stops when
/// dropped, or after a last collection with [`Housekeeping::finish`].
#[derive(Debug)]
pub struct Housekeeping {
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Housekeeping {
    /// Starts both for a program of `role` (inside a Tokio runtime).
    pub fn start(telemetry: &Telemetry, role: Role) -> Self {
        let stop = CancellationToken::new();
        let tasks = vec![
            telemetry.spawn_upkeep(stop.clone()),
            spawn(telemetry.clone(), role, DEFAULT_INTERVAL, stop.clone()),
        ];
        Housekeeping { stop, tasks }
    }

    /// Stops, after one last collection (so that a scrape after a run sees all of it).
    pub async fn finish(mut self) {
        self.stop.cancel();
        for t in std::mem::take(&mut self.tasks) {
            let _ = t.await;
        }
    }
}

impl Drop for Housekeeping {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn read(path: &'static str) -> Result<String, SysError> {
    std::fs::read_to_string(path).map_err(|source| SysError::Read { path, source })
}

/// Logs a failed source at warn the first time, at debug after that.
fn warn_once(warned: &mut bool, role: Role, e: &SysError) {
    let role = role.label();
    if std::mem::replace(warned, true) {
        tracing::debug!(role, error = %e, "system metrics source failed again");
    } else {
        tracing::warn!(
            role,
            error = %e,
            "system metrics source failed; its metrics keep their last values (further failures at debug)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::recorder::sample;

    /// `cat /proc/softirqs` on the 2-CPU development VM.
    const SOFTIRQS_2CPU: &str = "                    CPU0       CPU1       
          HI:          0          0
       TIMER:      45618      42748
      NET_TX:          4          0
      NET_RX:   10403218   11390023
       BLOCK:          0      72855
    IRQ_POLL:          0          0
     TASKLET:       1128         41
       SCHED:      63101      62838
     HRTIMER:          0          0
         RCU:      71854      76400
";

    /// A made-up 4-CPU file: tabs, runs of spaces, CRLF, blank lines, a row that stops
    /// early, and a vector no kernel has.
    const SOFTIRQS_4CPU_ODD: &str = "\n\t CPU0   CPU1 CPU2\tCPU3   \r\n\
HI:0 0 0 0\n\
   TIMER:\t1  2\t\t3 4\n\
NET_RX:   100 200 300 400   \r\n\
\n\
      BLOCK:  5 6\n\
NEW_THING:    7 8 9 10\n\
IRQ_POLL:\n\
\n\n";

    /// `/proc/stat` on the same VM (the `intr` and `softirq` lines shortened).
    const STAT_2CPU: &str = "cpu  132664 0 30791 296341 1649 0 7043 63 0 0
cpu0 64019 0 14339 151955 503 0 3350 29 0 0
cpu1 68645 0 16452 144386 1146 0 3693 34 0 0
intr 1994375 0 0 0 0
ctxt 4844841
btime 1796059433
processes 41381
procs_running 3
procs_blocked 0
softirq 26714694 0 96402 4 26239781 76560 0 1169 143669 0 157109
";

    fn row<'a>(s: &'a Softirqs, vector: &str) -> &'a [u64] {
        &s.rows
            .iter()
            .find(|r| r.vector == vector)
            .expect("the row is in the capture")
            .counts
    }

    #[test]
    fn parses_a_real_two_cpu_capture() {
        let s = parse_softirqs(SOFTIRQS_2CPU).expect("a real capture parses");
        assert_eq!(s.cpus, vec![0, 1]);
        let vectors: Vec<&str> = s.rows.iter().map(|r| r.vector.as_str()).collect();
        assert_eq!(
            vectors,
            [
                "hi", "timer", "net_tx", "net_rx", "block", "irq_poll", "tasklet", "sched",
                "hrtimer", "rcu"
            ]
        );
        assert_eq!(row(&s, "net_rx"), [10_403_218, 11_390_023]);
        assert_eq!(row(&s, "block"), [0, 72_855]);
        assert!(s.rows.iter().all(|r| r.counts.len() == 2));
    }

    #[test]
    fn tolerates_odd_spacing_short_rows_and_unknown_vectors() {
        let s = parse_softirqs(SOFTIRQS_4CPU_ODD).expect("odd spacing parses");
        assert_eq!(s.cpus, vec![0, 1, 2, 3]);
        assert_eq!(row(&s, "hi"), [0, 0, 0, 0]);
        assert_eq!(row(&s, "timer"), [1, 2, 3, 4]);
        assert_eq!(row(&s, "net_rx"), [100, 200, 300, 400]);
        assert_eq!(row(&s, "block"), [5, 6]);
        assert_eq!(row(&s, "new_thing"), [7, 8, 9, 10]);
        assert_eq!(row(&s, "irq_poll"), [] as [u64; 0]);
        assert_eq!(s.rows.len(), 6);
    }

    #[test]
    fn cpu_numbers_come_from_the_header_not_the_position() {
        let s = parse_softirqs("CPU0 CPU2 CPU7\nNET_RX: 1 2 3\n").expect("parses");
        assert_eq!(s.cpus, vec![0, 2, 7]);
    }

    #[test]
    fn malformed_input_gives_a_typed_error() {
        use SysError as E;
        /// Whether an error is the one expected.
        type Check = fn(&SysError) -> bool;
        let cases: &[(&str, Check)] = &[
            ("", |e| matches!(e, E::NoHeader)),
            (" \n\t\n", |e| matches!(e, E::NoHeader)),
            ("HI: 0 0\n", |e| matches!(e, E::BadHeader { line: 1, .. })),
            (
                "CPU0 CPUx\n",
                |e| matches!(e, E::BadHeader { token, .. } if token == "CPUx"),
            ),
            ("CPU0 CPU\n", |e| matches!(e, E::BadHeader { .. })),
            ("CPU0 CPU+1\n", |e| matches!(e, E::BadHeader { .. })),
            ("CPU0 CPU0\n", |e| matches!(e, E::BadHeader { .. })),
            ("CPU0 CPU99999999999\n", |e| {
                matches!(e, E::BadHeader { .. })
            }),
            ("CPU0\nHI 0\n", |e| matches!(e, E::BadRow { line: 2 })),
            ("CPU0\n  : 0\n", |e| matches!(e, E::BadRow { line: 2 })),
            (
                "CPU0\nHI: 12a\n",
                |e| matches!(e, E::BadCount { token, .. } if token == "12a"),
            ),
            ("CPU0\nHI: -1\n", |e| matches!(e, E::BadCount { .. })),
            ("CPU0\nHI: +1\n", |e| matches!(e, E::BadCount { .. })),
            ("CPU0\nHI: 1.5\n", |e| matches!(e, E::BadCount { .. })),
            ("CPU0\nHI: 99999999999999999999\n", |e| {
                matches!(e, E::BadCount { .. })
            }),
            ("CPU0 CPU1\nHI: 1 2 3\n", |e| {
                matches!(
                    e,
                    E::TooManyCounts {
                        line: 2,
                        counts: 3,
                        cpus: 2
                    }
                )
            }),
            (
                "CPU0\nHI: 1\nhi: 2\n",
                |e| matches!(e, E::DuplicateVector { line: 3, vector } if vector == "hi"),
            ),
        ];
        for (text, expected) in cases {
            match parse_softirqs(text) {
                Err(e) => assert!(expected(&e), "{text:?} gave {e:?}"),
                Ok(s) => panic!("{text:?} parsed as {s:?}"),
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn parse_softirqs_never_panics(text in "\\PC*") {
            let _ = parse_softirqs(&text);
        }

        #[test]
        fn parse_softirqs_never_panics_on_near_misses(
            text in "(CPU[0-9]{1,3}[ \t]*){0,5}\n([A-Z_]{0,6}:?[ \t0-9a-]{0,20}\n){0,6}"
        ) {
            let _ = parse_softirqs(&text);
        }
    }

    #[test]
    fn a_32_bit_count_that_wraps_keeps_growing() {
        assert_eq!(growth(10, 15), 5);
        assert_eq!(growth(u64::from(u32::MAX) - 1, 3), 5);
        // A count wider than 32 bits that drops has restarted from zero.
        assert_eq!(growth(1 << 40, 7), 7);

        let t = Telemetry::new();
        let mut m = SystemMetrics::new(&t, Role::Provider);
        let at = |count| Softirqs {
            cpus: vec![0],
            rows: vec![SoftirqRow {
                vector: "net_rx".into(),
                counts: vec![count],
            }],
        };
        m.record_softirqs(&at(u64::from(u32::MAX) - 9));
        m.record_softirqs(&at(20));
        let labels = [("role", "provider"), ("cpu", "0"), ("vector", "net_rx")];
        assert_eq!(
            sample(&t.render(), SOFTIRQS_TOTAL.name, &labels),
            Some((u64::from(u32::MAX) + 21) as f64)
        );
    }

    #[test]
    fn softirq_vectors_beyond_the_cap_get_no_series() {
        let t = Telemetry::new();
        let mut m = SystemMetrics::new(&t, Role::Provider);
        let s = Softirqs {
            cpus: vec![0],
            rows: (0..MAX_VECTORS + 8)
                .map(|i| SoftirqRow {
                    vector: format!("v{i}"),
                    counts: vec![1],
                })
                .collect(),
        };
        m.record_softirqs(&s);
        m.record_softirqs(&s);
        let series = t
            .render()
            .lines()
            .filter(|l| l.starts_with("rpcmesh_softirqs_total{"))
            .count();
        assert_eq!(series, MAX_VECTORS);
    }

    #[test]
    fn parses_a_real_stat_capture_with_cpu_numbers() {
        let cpus = parse_stat(STAT_2CPU).expect("a real capture parses");
        let ids: Vec<u32> = cpus.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, [0, 1]);
        assert_eq!(cpus[1].1.user, 68_645);
        assert_eq!(cpus[1].1.softirq, Some(3_693));
    }

    #[test]
    fn an_offline_cpu_does_not_shift_the_numbers() {
        let text = STAT_2CPU.replace("cpu1 ", "cpu2 ");
        let ids: Vec<u32> = parse_stat(&text)
            .expect("parses")
            .iter()
            .map(|(id, _)| *id)
            .collect();
        assert_eq!(ids, [0, 2]);
    }

    #[test]
    fn a_broken_stat_gives_a_typed_error() {
        assert!(matches!(parse_stat(""), Err(SysError::Stat(_))));
        assert!(matches!(
            parse_stat(&STAT_2CPU.replace("cpu1 68645", "cpu1 x")),
            Err(SysError::Stat(_))
        ));
        assert!(matches!(
            parse_stat(&STAT_2CPU.replace("cpu1 ", "cpux ")),
            Err(SysError::StatCpu { name }) if name == "cpux"
        ));
    }

    #[test]
    fn cpu_seconds_are_whole_seconds_and_never_go_back() {
        let t = Telemetry::new();
        let mut m = SystemMetrics::new(&t, Role::Provider);
        m.ticks_per_second = 100;
        m.record_stat(&parse_stat(STAT_2CPU).expect("parses"));
        // iowait of cpu1 moves back from 1146 to 1000 ticks: the counter holds.
        let back = STAT_2CPU.replace(
            "cpu1 68645 0 16452 144386 1146",
            "cpu1 68745 0 16452 144386 1000",
        );
        m.record_stat(&parse_stat(&back).expect("parses"));
        let text = t.render();
        let value = |cpu, mode| {
            sample(
                &text,
                CPU_SECONDS_TOTAL.name,
                &[("role", "provider"), ("cpu", cpu), ("mode", mode)],
            )
        };
        assert_eq!(value("0", "softirq"), Some(33.0));
        assert_eq!(value("1", "user"), Some(687.0));
        assert_eq!(value("1", "iowait"), Some(11.0));
        assert_eq!(value("1", "steal"), Some(0.0));
        assert_eq!(value("1", "guest"), None);
    }

    fn collected() -> String {
        let t = Telemetry::new();
        let mut m = SystemMetrics::new(&t, Role::Provider);
        m.collect();
        t.render()
    }

    #[test]
    fn collect_exports_softirqs_cpu_and_process_metrics() {
        let text = collected();
        for series in [
            r#"rpcmesh_softirqs_total{role="provider",cpu="0",vector="net_rx"} "#,
            r#"rpcmesh_cpu_seconds_total{role="provider",cpu="0",mode="softirq"} "#,
            r#"rpcmesh_cpu_seconds_total{role="provider",cpu="0",mode="idle"} "#,
            r#"rpcmesh_process_cpu_seconds_total{role="provider"} "#,
            r#"rpcmesh_process_cpu_seconds_sum{role="provider"} "#,
            r#"rpcmesh_process_resident_memory_bytes{role="provider"} "#,
            r#"rpcmesh_process_open_fds{role="provider"} "#,
            r#"rpcmesh_process_threads{role="provider"} "#,
        ] {
            assert!(text.contains(series), "no {series} in\n{text}");
        }
        assert!(
            text.contains("# TYPE rpcmesh_cpu_seconds_total counter"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE rpcmesh_process_cpu_seconds_total counter"),
            "{text}"
        );
        let rss = sample(&text, "rpcmesh_process_resident_memory_bytes", &[]);
        assert!(rss.is_some_and(|b| b > 0.0), "{text}");
    }

    #[test]
    fn promtool_finds_no_problems() {
        use std::io::Write;
        use std::process::{Command, Stdio};

        let text = collected();
        assert!(text.contains("rpcmesh_softirqs_total{"), "{text}");
        let child = Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "promtool is not on PATH: install Debian's `prometheus` package (scripts/deps \
                 does), then rerun"
            ),
            Err(e) => panic!("cannot run promtool: {e}"),
        };
        child
            .stdin
            .take()
            .expect("stdin is piped")
            .write_all(text.as_bytes())
            .expect("promtool reads its stdin");
        let out = child.wait_with_output().expect("promtool runs");
        let problems = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && problems.trim().is_empty(),
            "promtool ({}): {problems}\n{text}",
            out.status
        );
    }

    #[tokio::test]
    async fn spawn_collects_at_once_and_stops_when_cancelled() {
        let t = Telemetry::new();
        let stop = CancellationToken::new();
        let task = spawn(t.clone(), Role::Provider, Duration::ZERO, stop.clone());
        let seen = tokio::time::timeout(Duration::from_secs(10), async {
            while !t.render().contains(SOFTIRQS_TOTAL.name) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(seen.is_ok(), "nothing collected within 10 s");
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the task stops when cancelled")
            .expect("the task does not panic");
    }
}
