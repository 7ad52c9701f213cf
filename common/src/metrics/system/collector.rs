//! Collecting the system metrics of one program instance: reading the `/proc` files,
//! keeping what must be remembered between two readings, and recording the metrics.
//!
//! Owns the handles of the metrics listed in [`crate::metrics::system`]
//! ([`SystemMetrics`]), the state behind them (each softirq count's 64-bit total across
//! the kernel's 32-bit wraps, counters that never go back, the last totals behind the
//! exact histograms), the task that refreshes them every [`DEFAULT_INTERVAL`] and at each
//! scrape ([`spawn`]), and the logging of a source that fails. Leaves the text of the
//! files to the parsers (`parse.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{Counter, Gauge};
use procfs::CpuTime;

use super::SysError;
use super::parse::{CpuMode, Softirqs, parse_context_switches, parse_softirqs, parse_stat};
use crate::metrics::Telemetry;
use crate::metrics::catalogue::{
    CPU_SECONDS_TOTAL, Family, HOST_CPU_SECONDS, LOG_LINES_DROPPED_TOTAL,
    PROCESS_CONTEXT_SWITCHES_TOTAL, PROCESS_CPU_SECONDS, PROCESS_CPU_SECONDS_TOTAL,
    PROCESS_MAX_FDS, PROCESS_OPEN_FDS, PROCESS_RESIDENT_MEMORY_BYTES, PROCESS_START_TIME_SECONDS,
    PROCESS_THREADS, PROCESS_VIRTUAL_MEMORY_BYTES, PROCESS_VIRTUAL_MEMORY_MAX_BYTES, Role,
    SCRAPE_CONNECTIONS_CLOSED_TOTAL, SOFTIRQS_TOTAL,
};
use crate::metrics::endpoint::ScrapeClose;
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
        for (total, count) in counts.iter_mut().zip(parse_context_switches(&status)) {
            *total += count;
        }
    }
    counts
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

/// The CPU time this process has used, user and system, all its threads (those ended
/// too), in seconds to the nanosecond: the kernel's `CLOCK_PROCESS_CPUTIME_ID`, which sums
/// the scheduler's run time. `/proc/self/stat` (what `metrics-process` reads) gives the
/// same time in clock ticks, 10 ms each at `USER_HZ` 100: the CPU of a call at a low rate
/// would come in round steps of it.
pub fn process_cpu_seconds() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
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
    /// Log lines the process dropped (`crate::log_sink`).
    log_lines_dropped: Counter,
    /// The metrics endpoint's connections closed, by [`ScrapeClose::index`].
    scrape_closes: [Counter; ScrapeClose::ALL.len()],
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
            log_lines_dropped: telemetry
                .counter(&LOG_LINES_DROPPED_TOTAL, &[("role", role.label())]),
            scrape_closes: ScrapeClose::ALL.map(|r| {
                telemetry.counter(
                    &SCRAPE_CONNECTIONS_CLOSED_TOTAL,
                    &[("role", role.label()), ("reason", r.label())],
                )
            }),
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
        // The process clock, not `process`'s ticks (see [`process_cpu_seconds`]).
        self.record_process(&process, process_cpu_seconds());
        self.log_lines_dropped
            .absolute(crate::log_sink::dropped_lines());
        let closes = self.telemetry.scrape_closes();
        for (c, r) in self.scrape_closes.iter().zip(ScrapeClose::ALL) {
            c.absolute(closes.get(r));
        }
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

    /// Records the process's figures `m` and its CPU time, `seconds`.
    fn record_process(&mut self, m: &metrics_process::collector::Metrics, seconds: f64) {
        let (telemetry, role) = (&self.telemetry, self.role);
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
/// every scrape of the telemetry's endpoint, until `stop` is cancelled, and once more
/// then. The reads run on Tokio's blocking pool: they are file I/O, and listing
/// `/proc/self/fd` takes a while when thousands of connections are open.
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

/// The background work of a program's telemetry: collecting the system metrics
/// ([`spawn`]). Stops when
/// dropped, or after a last collection with [`Housekeeping::finish`].
#[derive(Debug)]
pub struct Housekeeping {
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Housekeeping {
    /// Starts it for a program of `role` (inside a Tokio runtime), and publishes the
    /// build it runs (`rpcmesh_build_info`), which every program exports with these.
    pub fn start(telemetry: &Telemetry, role: Role) -> Self {
        crate::metrics::families::publish_build_info(telemetry, role);
        let stop = CancellationToken::new();
        let tasks = vec![spawn(
            telemetry.clone(),
            role,
            DEFAULT_INTERVAL,
            stop.clone(),
        )];
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
    use crate::metrics::system::parse::SoftirqRow;
    use crate::metrics::system::parse::tests::STAT_2CPU;

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

    /// Burns CPU on this thread until the process clock has moved `by` seconds past
    /// `from`; the reading then.
    fn burn_past(from: f64, by: f64) -> f64 {
        let mut x = 0u64;
        loop {
            for i in 0..1000u64 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
            }
            let now = process_cpu_seconds();
            if now - from >= by {
                return now;
            }
        }
    }

    #[test]
    fn the_process_cpu_clock_is_finer_than_a_clock_tick() {
        let tick = 1.0 / procfs::ticks_per_second().max(1) as f64;
        let few_ms = tick / 10.0;
        // Readings a few ms of CPU apart: clock ticks would make them 0 or a whole tick.
        let first = process_cpu_seconds();
        let second = burn_past(first, few_ms);
        let d = second - first;
        assert!(d >= few_ms && d < tick, "{d} s apart (a tick is {tick} s)");

        // The exported time is that clock's: its sum moves as finely.
        let t = Telemetry::new();
        let mut m = SystemMetrics::new(&t, Role::Provider);
        let sum = |t: &Telemetry| {
            sample(&t.render(), "rpcmesh_process_cpu_seconds_sum", &[]).unwrap_or(0.0)
        };
        m.collect();
        let a = sum(&t);
        burn_past(process_cpu_seconds(), few_ms);
        m.collect();
        let d = sum(&t) - a;
        assert!(
            d >= few_ms && d < tick,
            "exported: {d} s apart (a tick is {tick} s)"
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
