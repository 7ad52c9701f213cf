//! Telemetry plumbing: one Prometheus recorder per program instance, from which each
//! program registers its metric handles once (at start or per connection) and then only
//! increments them on the hot path.
//!
//! Owns the recorder, its histogram buckets and rendering. The metric names and what
//! they mean are each program's (`metrics.rs` in each crate; `docs/metrics.md`).
//!
//! Handles are registered on the instance's own recorder rather than through the global
//! `metrics` macros, so that several providers and brokers in one test process keep
//! separate counts; `main` installs the same recorder globally as well.

use std::sync::Arc;

use metrics::{Counter, Gauge, Histogram, Key, Label, Metadata, Recorder};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};

/// Upper bounds (seconds) of every latency histogram: a 1-2-5 series from 10 µs to 10 s,
/// so that one set of buckets covers a loopback hop (tens of µs) and a timed-out call
/// (seconds) with at most a factor 2.5 between neighbours.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.000_01, 0.000_02, 0.000_05, 0.000_1, 0.000_2, 0.000_5, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05,
    0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
];

/// How often histogram samples are drained into buckets: often enough that at a million
/// samples a second the pending ones stay at a few MB.
pub const UPKEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

const METADATA: Metadata<'static> = Metadata::new("rpcmesh", metrics::Level::INFO, None);

/// A recorder of one program instance, and the handle that renders it; or nothing at all
/// ([`Telemetry::discard`]), when no one can read the metrics.
#[derive(Clone)]
pub struct Telemetry {
    inner: Option<(Arc<PrometheusRecorder>, PrometheusHandle)>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("recording", &self.inner.is_some())
            .finish_non_exhaustive()
    }
}

impl Default for Telemetry {
    fn default() -> Self {
        Telemetry::new()
    }
}

impl Telemetry {
    /// A fresh recorder with rpcmesh's histogram buckets, kept in memory (tests read it
    /// with [`Telemetry::render`]).
    pub fn new() -> Self {
        let recorder = PrometheusBuilder::new()
            .set_buckets(LATENCY_BUCKETS)
            .expect("the bucket list is a non-empty constant")
            .build_recorder();
        let handle = recorder.handle();
        Telemetry {
            inner: Some((Arc::new(recorder), handle)),
        }
    }

    /// No recorder: every handle is a no-op (the metrics endpoint is off, so nothing
    /// recorded could be read, and the hot path pays nothing for it).
    pub fn discard() -> Self {
        Telemetry { inner: None }
    }

    /// True when metrics are recorded.
    pub fn is_recording(&self) -> bool {
        self.inner.is_some()
    }

    /// A recorder whose `/metrics` is served over HTTP on `addr` (Prometheus text format),
    /// with its upkeep running every few seconds. Must be called inside a Tokio runtime.
    pub fn serve_http(
        addr: std::net::SocketAddr,
    ) -> Result<Self, metrics_exporter_prometheus::BuildError> {
        let (recorder, exporter) = PrometheusBuilder::new()
            .set_buckets(LATENCY_BUCKETS)?
            .with_http_listener(addr)
            .build()?;
        tokio::spawn(async move {
            if let Err(e) = exporter.await {
                tracing::error!(error = ?e, "metrics endpoint stopped");
            }
        });
        tracing::info!(%addr, "metrics served at /metrics");
        let handle = recorder.handle();
        Ok(Telemetry {
            inner: Some((Arc::new(recorder), handle)),
        })
    }

    /// Registers (or finds) a counter.
    pub fn counter(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Counter {
        match &self.inner {
            Some((r, _)) => r.register_counter(&key(name, labels), &METADATA),
            None => Counter::noop(),
        }
    }

    /// Registers (or finds) a gauge.
    pub fn gauge(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Gauge {
        match &self.inner {
            Some((r, _)) => r.register_gauge(&key(name, labels), &METADATA),
            None => Gauge::noop(),
        }
    }

    /// Registers (or finds) a histogram.
    pub fn histogram(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Histogram {
        match &self.inner {
            Some((r, _)) => r.register_histogram(&key(name, labels), &METADATA),
            None => Histogram::noop(),
        }
    }

    /// Attaches help text to a metric name (the exporter keeps one description per name,
    /// whatever its kind).
    pub fn describe(&self, name: &'static str, unit: Option<metrics::Unit>, help: &'static str) {
        if let Some((r, _)) = &self.inner {
            r.describe_counter(name.into(), unit, help.into());
        }
    }

    /// Attaches help text to a histogram's name.
    pub fn describe_histogram(
        &self,
        name: &'static str,
        unit: Option<metrics::Unit>,
        help: &'static str,
    ) {
        if let Some((r, _)) = &self.inner {
            r.describe_histogram(name.into(), unit, help.into());
        }
    }

    /// The Prometheus text exposition of everything recorded so far.
    pub fn render(&self) -> String {
        self.inner
            .as_ref()
            .map_or_else(String::new, |(_, h)| h.render())
    }

    /// Drains histogram samples into their buckets; run it periodically so that samples
    /// do not pile up between scrapes.
    pub fn run_upkeep(&self) {
        if let Some((_, h)) = &self.inner {
            h.run_upkeep();
        }
    }

    /// Runs [`Telemetry::run_upkeep`] every [`UPKEEP_INTERVAL`] until `stop`: without it,
    /// histogram samples of a recorder nobody scrapes would pile up in memory.
    pub fn spawn_upkeep(
        &self,
        stop: crate::shutdown::CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let handle = self.inner.as_ref().map(|(_, h)| h.clone());
        tokio::spawn(async move {
            let Some(handle) = handle else { return };
            let mut tick = tokio::time::interval(UPKEEP_INTERVAL);
            loop {
                tokio::select! {
                    _ = tick.tick() => handle.run_upkeep(),
                    () = stop.cancelled() => return,
                }
            }
        })
    }
}

/// One call in this many has its stages timed unless configured otherwise: a timestamp
/// costs about 24 ns and a histogram sample about 26 ns, so timing every call of a
/// five-stage program costs ~0.25 µs, a fifth of a provider's whole per-call CPU at high
/// rates; one in 8 keeps that under 3 % while a busy connection still gives thousands of
/// samples a second, plenty for p99.9.
pub const DEFAULT_STAGE_SAMPLE: u32 = 8;

/// Per-stage latency histograms of one role, `rpcmesh_stage_seconds{role, stage}`: one
/// family across the three programs, with the same stage name wherever it means the same
/// thing (see `docs/metrics.md` for where each stage starts and ends).
///
/// Stages are timed on a sample of calls, one in `every` (each connection picks with its own
/// [`Sampler`]); the histograms' quantiles describe all calls, their `_count` is the number
/// of timed calls. With `every` = 0 (`--stage-metrics off`) every handle is a no-op and no
/// call is picked, so the hot path takes no timestamps at all.
#[derive(Clone)]
pub struct Stages {
    hists: Vec<Histogram>,
    every: u32,
}

impl std::fmt::Debug for Stages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stages")
            .field("every", &self.every)
            .finish_non_exhaustive()
    }
}

impl Stages {
    /// Registers one histogram per stage name, in order (index = the caller's stage
    /// constant); one call in `every` is timed, none when `every` is 0.
    pub fn new(t: &Telemetry, role: &'static str, names: &[&'static str], every: u32) -> Self {
        Stages {
            hists: names
                .iter()
                .map(|s| {
                    if every > 0 {
                        t.histogram("rpcmesh_stage_seconds", &[("role", role), ("stage", s)])
                    } else {
                        Histogram::noop()
                    }
                })
                .collect(),
            every,
        }
    }

    /// True when stages are recorded at all.
    pub fn on(&self) -> bool {
        self.every > 0
    }

    /// A sampler for one connection.
    pub fn sampler(&self) -> Sampler {
        Sampler {
            every: self.every,
            // Connections start at different points of the cycle.
            n: fastrand::u32(..self.every.max(1)),
        }
    }

    /// Records one stage's duration.
    pub fn record(&self, stage: usize, d: std::time::Duration) {
        if let Some(h) = self.hists.get(stage) {
            h.record(d.as_secs_f64());
        }
    }

    /// Records `to - from` (zero if `to` is earlier).
    pub fn record_span(&self, stage: usize, from: std::time::Instant, to: std::time::Instant) {
        self.record(stage, to.saturating_duration_since(from));
    }
}

/// The stage-timing flags every program takes.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct StageArgs {
    /// Record per-stage latency histograms (off: the hot path takes no timestamps).
    #[arg(long, env = "RPCMESH_STAGE_METRICS", default_value = "on", value_parser = crate::runtime::parse_on_off, action = clap::ArgAction::Set)]
    pub stage_metrics: bool,
    /// Time the stages of one call in this many (1 = every call).
    #[arg(long, env = "RPCMESH_STAGE_SAMPLE", default_value_t = DEFAULT_STAGE_SAMPLE)]
    pub stage_sample: u32,
}

impl StageArgs {
    /// One call in how many is timed; 0 = none.
    pub fn every(&self) -> u32 {
        if self.stage_metrics {
            self.stage_sample.max(1)
        } else {
            0
        }
    }
}

/// Picks the calls whose stages are timed: one in `every`, in turn.
#[derive(Clone, Debug)]
pub struct Sampler {
    every: u32,
    n: u32,
}

impl Sampler {
    /// True when the next call is to be timed.
    #[inline]
    pub fn pick(&mut self) -> bool {
        if self.every == 0 {
            return false;
        }
        self.n += 1;
        if self.n >= self.every {
            self.n = 0;
            true
        } else {
            false
        }
    }

    /// `Instant::now()` when the next call is to be timed.
    #[inline]
    pub fn stamp(&mut self) -> Option<std::time::Instant> {
        self.pick().then(std::time::Instant::now)
    }
}

/// Every kind of error rpcmesh counts, the `kind` label of `rpcmesh_errors_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Bytes that are not an RPCF stream (junk skipped, or connection closed).
    BadMagic,
    /// A protocol version other than 1.
    BadVersion,
    /// `body_len` over the limit.
    TooLarge,
    /// CRC trailer mismatch.
    Crc,
    /// Unknown message type or reserved bits.
    UnknownType,
    /// Connection closed in the middle of a frame.
    Truncated,
    /// Body lengths that do not add up, or names that are not UTF-8.
    BadBody,
    /// A payload flagged compressed that does not inflate, or inflates past the limit.
    Inflate,
    /// A payload that is not the expected protobuf message.
    Decode,
    /// A call to a service nobody serves.
    UnknownService,
    /// A call to a method the service does not have.
    UnknownMethod,
    /// No reply within the deadline.
    Timeout,
    /// A reply that came after its call had timed out (dropped).
    LateReply,
    /// No healthy provider / connection lost with the call on it.
    Unavailable,
    /// Shed by a limit on calls in flight.
    Overloaded,
    /// A frame of a type that makes no sense in that direction (dropped).
    Unexpected,
    /// A socket error.
    Io,
}

impl ErrorKind {
    /// Every kind, in label order.
    pub const ALL: [ErrorKind; 17] = [
        ErrorKind::BadMagic,
        ErrorKind::BadVersion,
        ErrorKind::TooLarge,
        ErrorKind::Crc,
        ErrorKind::UnknownType,
        ErrorKind::Truncated,
        ErrorKind::BadBody,
        ErrorKind::Inflate,
        ErrorKind::Decode,
        ErrorKind::UnknownService,
        ErrorKind::UnknownMethod,
        ErrorKind::Timeout,
        ErrorKind::LateReply,
        ErrorKind::Unavailable,
        ErrorKind::Overloaded,
        ErrorKind::Unexpected,
        ErrorKind::Io,
    ];

    /// The `kind` label.
    pub fn label(self) -> &'static str {
        match self {
            ErrorKind::BadMagic => "bad_magic",
            ErrorKind::BadVersion => "bad_version",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::Crc => "crc",
            ErrorKind::UnknownType => "unknown_type",
            ErrorKind::Truncated => "truncated",
            ErrorKind::BadBody => "bad_body",
            ErrorKind::Inflate => "inflate",
            ErrorKind::Decode => "decode",
            ErrorKind::UnknownService => "unknown_service",
            ErrorKind::UnknownMethod => "unknown_method",
            ErrorKind::Timeout => "timeout",
            ErrorKind::LateReply => "late_reply",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::Unexpected => "unexpected",
            ErrorKind::Io => "io",
        }
    }

    /// The kind of a wire-layer error.
    pub fn of_frame(e: &crate::frame::FrameError) -> ErrorKind {
        use crate::frame::FrameError as F;
        match e {
            F::BadMagic { .. } | F::Resynced { .. } => ErrorKind::BadMagic,
            F::BadVersion { .. } => ErrorKind::BadVersion,
            F::TooLarge { .. } => ErrorKind::TooLarge,
            F::Crc { .. } => ErrorKind::Crc,
            F::UnknownType { .. } => ErrorKind::UnknownType,
            F::Truncated { .. } => ErrorKind::Truncated,
            F::BadBody { .. } | F::Unencodable { .. } => ErrorKind::BadBody,
        }
    }

    /// The kind of a call-layer error.
    pub fn of_call(e: &crate::call::CallError) -> ErrorKind {
        use crate::call::CallError as C;
        match e {
            C::Frame(f) => ErrorKind::of_frame(f),
            C::Inflate(_) => ErrorKind::Inflate,
            C::Decode(_) | C::UnknownStatus(_) => ErrorKind::Decode,
            C::WrongType { .. } => ErrorKind::Unexpected,
        }
    }
}

/// Bad input seen on one connection: each event is counted and logged (the first
/// [`BadInputLog::FIRST`], then one in [`BadInputLog::THIN_EVERY`], so a peer cannot flood
/// the log), and the request an error reply is due to is returned.
#[derive(Debug, Default)]
pub struct BadInputLog {
    seen: u64,
}

impl BadInputLog {
    /// Log lines per connection before they are thinned: enough to diagnose.
    pub const FIRST: u64 = 10;
    /// After that, one line in this many.
    pub const THIN_EVERY: u64 = 1000;

    /// Counts and logs `e` (from a `peer` such as "client"); returns the id and flags of
    /// the request to answer with an error, when there is one.
    pub fn record(
        &mut self,
        e: &crate::frame::FrameError,
        errors: &ErrorCounters,
        peer: &'static str,
    ) -> Option<(u64, crate::frame::Flags)> {
        errors.inc(ErrorKind::of_frame(e));
        self.seen += 1;
        let n = self.seen;
        if n <= Self::FIRST || n % Self::THIN_EVERY == 0 {
            tracing::warn!(error = %e, fatal = e.is_fatal(), seen = n, peer, "bad input");
        }
        e.request_id().map(|id| (id, e.flags()))
    }
}

/// `rpcmesh_errors_total{role, kind}`, one handle per kind, registered up front.
#[derive(Clone)]
pub struct ErrorCounters(Vec<Counter>);

impl std::fmt::Debug for ErrorCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ErrorCounters")
    }
}

impl ErrorCounters {
    /// Registers one counter per kind for `role`.
    pub fn new(t: &Telemetry, role: &'static str) -> Self {
        ErrorCounters(
            ErrorKind::ALL
                .iter()
                .map(|k| {
                    t.counter(
                        "rpcmesh_errors_total",
                        &[("role", role), ("kind", k.label())],
                    )
                })
                .collect(),
        )
    }

    /// Counts one error.
    pub fn inc(&self, kind: ErrorKind) {
        self.0[kind as usize].increment(1);
    }
}

/// Connection counters of one side of a program: `rpcmesh_connections_opened_total`,
/// `_closed_total`, `_refused_total` and the `rpcmesh_connections_open` gauge, labelled
/// `role` and `side` (`inbound` = callers connecting to us, `upstream` = our connections to
/// providers, `outbound` = the driver's connections).
#[derive(Clone, Debug)]
pub struct ConnCounters {
    opened: Counter,
    closed: Counter,
    refused: Counter,
    open: Gauge,
}

impl ConnCounters {
    /// Registers the counters.
    pub fn new(t: &Telemetry, role: &'static str, side: &'static str) -> Self {
        let l = [("role", role), ("side", side)];
        ConnCounters {
            opened: t.counter("rpcmesh_connections_opened_total", &l),
            closed: t.counter("rpcmesh_connections_closed_total", &l),
            refused: t.counter("rpcmesh_connections_refused_total", &l),
            open: t.gauge("rpcmesh_connections_open", &l),
        }
    }
}

impl crate::listener::AcceptObserver for ConnCounters {
    fn opened(&self) {
        self.opened.increment(1);
        self.open.increment(1.0);
    }
    fn closed(&self) {
        self.closed.increment(1);
        self.open.decrement(1.0);
    }
    fn refused(&self) {
        self.refused.increment(1);
    }
}

/// Bytes on the wire, `rpcmesh_wire_bytes_total{role, side, direction="in"|"out"}`, and
/// the `read`/`write` calls that moved them, `rpcmesh_wire_syscalls_total{...}` (calls per
/// syscall is how well frames are batched).
#[derive(Clone, Debug)]
pub struct WireCounters {
    read: Counter,
    written: Counter,
    reads: Counter,
    writes: Counter,
}

impl WireCounters {
    /// Registers the counters.
    pub fn new(t: &Telemetry, role: &'static str, side: &'static str) -> Self {
        let l = |d| [("role", role), ("side", side), ("direction", d)];
        WireCounters {
            read: t.counter("rpcmesh_wire_bytes_total", &l("in")),
            written: t.counter("rpcmesh_wire_bytes_total", &l("out")),
            reads: t.counter("rpcmesh_wire_syscalls_total", &l("in")),
            writes: t.counter("rpcmesh_wire_syscalls_total", &l("out")),
        }
    }

    /// Adds a connection's counts since the last call.
    pub fn add(&self, c: crate::io::IoCounts) {
        if c.bytes_read > 0 {
            self.read.increment(c.bytes_read);
        }
        if c.bytes_written > 0 {
            self.written.increment(c.bytes_written);
        }
        if c.reads > 0 {
            self.reads.increment(c.reads);
        }
        if c.writes > 0 {
            self.writes.increment(c.writes);
        }
    }
}

/// Payload bytes before and after compression:
/// `rpcmesh_payload_bytes_total{role, direction, form="plain"|"wire"}`. The compression
/// ratio is `wire / plain`.
#[derive(Clone, Debug)]
pub struct PayloadCounters {
    in_plain: Counter,
    in_wire: Counter,
    out_plain: Counter,
    out_wire: Counter,
}

impl PayloadCounters {
    /// Registers the counters.
    pub fn new(t: &Telemetry, role: &'static str) -> Self {
        let c = |d, f| {
            t.counter(
                "rpcmesh_payload_bytes_total",
                &[("role", role), ("direction", d), ("form", f)],
            )
        };
        PayloadCounters {
            in_plain: c("in", "plain"),
            in_wire: c("in", "wire"),
            out_plain: c("out", "plain"),
            out_wire: c("out", "wire"),
        }
    }

    /// Counts a payload received.
    pub fn received(&self, s: crate::call::PayloadSize) {
        self.in_plain.increment(s.plain as u64);
        self.in_wire.increment(s.wire as u64);
    }

    /// Counts a payload sent.
    pub fn sent(&self, s: crate::call::PayloadSize) {
        self.out_plain.increment(s.plain as u64);
        self.out_wire.increment(s.wire as u64);
    }
}

/// `rpcmesh_calls_total{role, service, method, status}` of one method, one handle per
/// status.
#[derive(Clone)]
pub struct CallCounters(Vec<Counter>);

impl std::fmt::Debug for CallCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallCounters")
    }
}

impl CallCounters {
    /// Label used for service and method names that are not configured, so that callers
    /// cannot create label values at will.
    pub const OTHER: &'static str = "_other";

    /// Registers the counters of `service.method`.
    pub fn new(t: &Telemetry, role: &'static str, service: &str, method: &str) -> Self {
        CallCounters(
            crate::status::Status::ALL
                .iter()
                .map(|s| {
                    t.counter(
                        "rpcmesh_calls_total",
                        &[
                            ("role", role),
                            ("service", service),
                            ("method", method),
                            ("status", s.label()),
                        ],
                    )
                })
                .collect(),
        )
    }

    /// Counts one finished call.
    pub fn inc(&self, status: crate::status::Status) {
        self.0[status as usize].increment(1);
    }
}

/// A `--metrics-listen` value: `HOST:PORT`, or `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetricsListen(pub Option<std::net::SocketAddr>);

impl std::str::FromStr for MetricsListen {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("off") || s.eq_ignore_ascii_case("none") {
            return Ok(MetricsListen(None));
        }
        s.parse()
            .map(|a| MetricsListen(Some(a)))
            .map_err(|e| format!("{s}: {e} (expected HOST:PORT or off)"))
    }
}

/// The telemetry of a program: served over HTTP when an address is given, discarded
/// otherwise.
pub fn start(listen: MetricsListen) -> Result<Telemetry, metrics_exporter_prometheus::BuildError> {
    match listen.0 {
        Some(a) => Telemetry::serve_http(a),
        None => Ok(Telemetry::discard()),
    }
}

fn key(name: &'static str, labels: &[(&'static str, &str)]) -> Key {
    let labels: Vec<Label> = labels
        .iter()
        .map(|(k, v)| Label::new(*k, v.to_string()))
        .collect();
    Key::from_parts(name, labels)
}

/// The value of one sample in a Prometheus text exposition: the line whose name is
/// `name` and whose labels include all of `labels`. Sums over every matching line.
/// For tests and tools.
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (label_text, value) = match rest.strip_prefix('{') {
            Some(r) => match r.split_once("} ") {
                Some((l, v)) => (l, v),
                None => continue,
            },
            None => match rest.strip_prefix(' ') {
                Some(v) => ("", v),
                None => continue,
            },
        };
        let ok = labels
            .iter()
            .all(|(k, v)| label_text.contains(&format!("{k}=\"{v}\"")));
        if ok {
            if let Ok(v) = value.trim().parse::<f64>() {
                *found.get_or_insert(0.0) += v;
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instances_count_separately() {
        let a = Telemetry::new();
        let b = Telemetry::new();
        a.counter("rpcmesh_test_total", &[("kind", "x")])
            .increment(3);
        b.counter("rpcmesh_test_total", &[("kind", "x")])
            .increment(1);
        assert_eq!(
            sample(&a.render(), "rpcmesh_test_total", &[("kind", "x")]),
            Some(3.0)
        );
        assert_eq!(sample(&b.render(), "rpcmesh_test_total", &[]), Some(1.0));
        assert_eq!(
            sample(&b.render(), "rpcmesh_test_total", &[("kind", "y")]),
            None
        );
    }

    #[test]
    fn histograms_use_the_latency_buckets() {
        let t = Telemetry::new();
        t.histogram("rpcmesh_stage_seconds", &[("stage", "handler")])
            .record(0.000_3);
        let text = t.render();
        assert!(
            text.contains("rpcmesh_stage_seconds_bucket{stage=\"handler\",le=\"0.0005\"} 1"),
            "{text}"
        );
        assert!(text.contains("le=\"0.00001\""), "{text}");
    }
}
