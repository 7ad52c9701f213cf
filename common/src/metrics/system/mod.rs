//! System metrics of one program instance, read from `/proc`: per CPU, the count of every
//! softirq vector (`/proc/softirqs`) and the time spent in each mode (`/proc/stat`); the
//! process's own CPU time, memory, file descriptors and threads (`/proc/self`); and the log
//! lines it dropped (`crate::log_sink`).
//!
//! Two parts, kept apart so that the parsing is tested on made-up text and the collecting
//! on made-up readings:
//!
//! - `parse.rs`: pure functions from the text of a `/proc` file to values: the rows of
//!   `/proc/softirqs` ([`parse_softirqs`]; no crate parses it), the CPUs of `/proc/stat`
//!   with their numbers ([`parse_stat`], over `procfs`'s parser), a thread's context
//!   switches, and the modes of a CPU's time. No I/O, no metrics.
//! - `collector.rs`: what reads the files, keeps the state between two readings (a 32-bit
//!   count that wrapped, a count that must not go back, the last totals behind the exact
//!   histograms), registers and updates the metrics below ([`SystemMetrics`]), and the
//!   task that refreshes them ([`spawn`], [`Housekeeping`]).
//!
//! Leaves the metrics' names, labels and help to the catalogue
//! ([`crate::metrics::catalogue`]); the recorder, its rendering and the `/metrics` endpoint
//! to [`crate::metrics::recorder`]; the parsing of the rest of `/proc/stat` to `procfs` and
//! of `/proc/self` to `metrics-process`; and when to start and stop collecting to each
//! program's `run`.
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
//! | `rpcmesh_log_lines_dropped_total` (the process's count in [`crate::log_sink`]) | counter | `role` |
//! | `rpcmesh_scrape_connections_closed_total` (the metrics endpoint's count, [`crate::metrics::endpoint::ScrapeClose`]) | counter | `role`, `reason` |
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
//! are the interface that queries are written against: once [`crate::metrics::recorder`]
//! can render float counters, these become exact without any query changing.
//!
//! `/proc/softirqs` prints each count as a 32-bit unsigned int that wraps (in about 12 h
//! at 100 000 `NET_RX` per second on one CPU). Each series therefore keeps its own 64-bit
//! total, advanced by the growth since the previous reading modulo 2³², so the exported
//! counter neither wraps nor sticks.
//!
//! # Fractional process CPU time
//!
//! For CPU per call the whole seconds of the process counter are too coarse, so the same
//! time is also exported exactly as the histogram `rpcmesh_process_cpu_seconds`. Both are
//! read from the process's own CPU clock (`CLOCK_PROCESS_CPUTIME_ID`, to the nanosecond),
//! not from `/proc/self/stat`, whose clock ticks (10 ms) would make a call's CPU at a low
//! rate come in round steps: each
//! collection observes the CPU time used since the previous one (the first, the time used
//! since the process started). Its `_sum` is therefore the process's CPU time in
//! fractional seconds, a float that only grows: `rate(rpcmesh_process_cpu_seconds_sum[1m])`
//! is the CPU the process uses, in cores. (A histogram's `_sum` is the one float counter
//! the exporter renders.) Its buckets say little: collections come every 5 s and at every
//! scrape, so their intervals vary.
//!
//! The host's time in each mode, summed over its CPUs, is exported exactly the same way:
//! `rpcmesh_host_cpu_seconds{mode}`, one observation per collection (the first reading
//! only sets the start), so its `_sum` is a fractional counter and the softirq share over
//! any window is `rate(rpcmesh_host_cpu_seconds_sum{mode="softirq"}[1m]) / ignoring(mode)
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

mod collector;
mod parse;

pub use collector::{
    DEFAULT_INTERVAL, Housekeeping, MAX_VECTORS, MIN_INTERVAL, SystemMetrics, host_cpu_seconds,
    process_cpu_seconds, spawn,
};
pub use parse::{SoftirqRow, Softirqs, parse_softirqs, parse_stat};

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
