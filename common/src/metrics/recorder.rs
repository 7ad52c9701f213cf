//! The recorder: one Prometheus recorder per program instance, from which each program
//! registers its metric handles once (at start or per connection) and then only increments
//! them on the hot path; its histogram buckets and its rendering.
//!
//! Owns the recorder. What each family is called and means is the catalogue's
//! ([`crate::metrics::catalogue`]): handles are registered by [`Family`], never by a name
//! spelled at the call site. Serving the rendering is [`crate::metrics::endpoint`]'s;
//! reading it back (a series' value, whether a line carries a label) is
//! [`crate::metrics::exposition`]'s.
//!
//! Counters and gauges live in the exporter (`metrics-exporter-prometheus`); histograms
//! in [`crate::metrics::buckets`], which records a sample without allocating, and are
//! rendered after the exporter's text.
//!
//! Handles are registered on the instance's own recorder rather than through the global
//! `metrics` macros, so that several providers and brokers in one test process keep
//! separate counts.
//!
//! Series of something that comes and goes (the broker's providers: a provider that left
//! the providers file) are exported only while an [`Exposure`] of their label lives: the
//! exporter cannot delete a series, so the rendering leaves them out instead, and a
//! provider that left is neither graphed nor alerted on for ever.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use metrics::{Counter, Gauge, Histogram, Key, Label, Metadata, Recorder};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};

use crate::metrics::buckets::{self, Buckets, Series};
use crate::metrics::catalogue::{self, Family, Kind};
use crate::metrics::exposition::LabelPair;
// The reader of what `Telemetry::render` writes, where the test kit, the tests and the
// capacity probe look for it.
pub use crate::metrics::exposition::sample;

/// Upper bounds (seconds) of every latency histogram: a 1-2-5 series from 10 µs to 10 s,
/// so that one set of buckets covers a loopback hop (tens of µs) and a timed-out call
/// (seconds) with at most a factor 2.5 between neighbours.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.000_01, 0.000_02, 0.000_05, 0.000_1, 0.000_2, 0.000_5, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05,
    0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
];

const METADATA: Metadata<'static> = Metadata::new("rpcmesh", metrics::Level::INFO, None);

/// Work run before each scrape's rendering (see [`Telemetry::on_scrape`]).
pub type Refresh = Arc<dyn Fn() + Send + Sync>;

/// For each (label name, value) ever given an [`Exposure`], how many live now; at zero the
/// value's series are left out of the rendering. One entry per value ever exposed (a
/// broker's: per provider address it ever served), as the exporter keeps their series.
type Exposures = Arc<Mutex<HashMap<(&'static str, String), usize>>>;

/// Keeps the series labelled `label="value"` in the rendering while it lives (it and any
/// other exposure of the same label and value); made by [`Telemetry::exposure`]. Once
/// the last is dropped, they are left out until another is made (their counts go on
/// from where they were, as the series are the exporter's).
#[derive(Debug)]
pub struct Exposure {
    exposures: Exposures,
    key: (&'static str, String),
}

impl Drop for Exposure {
    fn drop(&mut self) {
        let mut all = self.exposures.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = all.get_mut(&self.key) {
            *n = n.saturating_sub(1);
        }
    }
}

/// A recorder of one program instance, and the handle that renders it; or nothing at all
/// ([`Telemetry::discard`]), when no one can read the metrics.
#[derive(Clone)]
pub struct Telemetry {
    inner: Option<(Arc<PrometheusRecorder>, PrometheusHandle)>,
    /// The histograms' series, in registration order.
    histograms: Arc<Mutex<Vec<Series>>>,
    refresh: Arc<Mutex<Vec<Refresh>>>,
    exposures: Exposures,
    served_at: Option<std::net::SocketAddr>,
    /// The metrics endpoint's connections closed, by reason (published with the system
    /// metrics, which know the program's role).
    scrape_closes: Arc<crate::metrics::endpoint::ScrapeCloses>,
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
        let recorder = PrometheusBuilder::new().build_recorder();
        Telemetry::recording(recorder)
    }

    /// A recorder with the catalogue's help text on every family.
    fn recording(recorder: PrometheusRecorder) -> Self {
        let handle = recorder.handle();
        let t = Telemetry {
            inner: Some((Arc::new(recorder), handle)),
            histograms: Arc::default(),
            refresh: Arc::default(),
            exposures: Arc::default(),
            served_at: None,
            scrape_closes: Arc::default(),
        };
        catalogue::describe_all(&t);
        t
    }

    /// No recorder: every handle is a no-op (the metrics endpoint is off, so nothing
    /// recorded could be read, and the hot path pays nothing for it).
    pub fn discard() -> Self {
        Telemetry {
            inner: None,
            histograms: Arc::default(),
            refresh: Arc::default(),
            exposures: Arc::default(),
            served_at: None,
            scrape_closes: Arc::default(),
        }
    }

    /// True when metrics are recorded.
    pub fn is_recording(&self) -> bool {
        self.inner.is_some()
    }

    /// A recorder whose `/metrics` is served over HTTP on `addr` (port 0 picks one; see
    /// [`Telemetry::served_at`]) by [`crate::metrics::endpoint`]. Must be called inside a
    /// Tokio runtime.
    pub fn serve_http(addr: std::net::SocketAddr) -> std::io::Result<Self> {
        let mut t = Telemetry::new();
        let bound = crate::metrics::endpoint::serve(t.clone(), addr)?;
        t.served_at = Some(bound);
        tracing::info!(addr = %bound, "metrics served at /metrics");
        Ok(t)
    }

    /// Where `/metrics` is served, if it is.
    pub fn served_at(&self) -> Option<std::net::SocketAddr> {
        self.served_at
    }

    /// The metrics endpoint's connections closed so far, by reason.
    pub fn scrape_closes(&self) -> &Arc<crate::metrics::endpoint::ScrapeCloses> {
        &self.scrape_closes
    }

    /// Runs `f` before every scrape's rendering (on a blocking thread), so that figures
    /// read from outside (`/proc`) are current when scraped.
    pub fn on_scrape(&self, f: Refresh) {
        if self.inner.is_some() {
            self.refresh
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(f);
        }
    }

    /// Runs every [`Telemetry::on_scrape`] hook.
    pub fn refresh(&self) {
        let hooks = self
            .refresh
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for h in hooks {
            h();
        }
    }

    /// Registers (or finds) a counter of the catalogued `family`, with `labels` (their
    /// names in the catalogue's order).
    pub fn counter(&self, family: &'static Family, labels: &[(&'static str, &str)]) -> Counter {
        family.check(Kind::Counter, labels);
        match &self.inner {
            Some((r, _)) => r.register_counter(&key(family.name, labels), &METADATA),
            None => Counter::noop(),
        }
    }

    /// Registers (or finds) a gauge of `family`.
    pub fn gauge(&self, family: &'static Family, labels: &[(&'static str, &str)]) -> Gauge {
        family.check(Kind::Gauge, labels);
        match &self.inner {
            Some((r, _)) => r.register_gauge(&key(family.name, labels), &METADATA),
            None => Gauge::noop(),
        }
    }

    /// Registers (or finds) a histogram of `family` ([`crate::metrics::buckets`]).
    pub fn histogram(&self, family: &'static Family, labels: &[(&'static str, &str)]) -> Histogram {
        family.check(Kind::Histogram, labels);
        if self.inner.is_none() {
            return Histogram::noop();
        }
        let mut all = self.histograms.lock().unwrap_or_else(|e| e.into_inner());
        let same = |s: &&Series| {
            std::ptr::eq(s.family, family)
                && s.labels.len() == labels.len()
                && s.labels
                    .iter()
                    .zip(labels)
                    .all(|(a, b)| a.0 == b.0 && a.1 == b.1)
        };
        if let Some(s) = all.iter().find(same) {
            return Histogram::from_arc(s.buckets.clone());
        }
        let buckets = Arc::new(Buckets::default());
        all.push(Series {
            family,
            labels: labels.iter().map(|(k, v)| (*k, v.to_string())).collect(),
            buckets: buckets.clone(),
        });
        Histogram::from_arc(buckets)
    }

    /// Attaches `family`'s help text and unit to its name (the exporter keeps one
    /// description per name, so the catalogue's is the only one).
    pub fn describe(&self, family: &Family) {
        let Some((r, _)) = &self.inner else { return };
        let (name, unit, help) = (family.name.into(), family.unit(), family.help.into());
        match family.kind {
            // Rendered with the catalogue's help by `buckets`.
            Kind::Histogram => {}
            Kind::Counter => r.describe_counter(name, unit, help),
            Kind::Gauge => r.describe_gauge(name, unit, help),
        }
    }

    /// Keeps the series labelled `label="value"` exported while the returned exposure
    /// (or another of the same pair) lives; see [`Exposure`].
    pub fn exposure(&self, label: &'static str, value: &str) -> Exposure {
        let key = (label, value.to_string());
        *self
            .exposures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key.clone())
            .or_default() += 1;
        Exposure {
            exposures: self.exposures.clone(),
            key,
        }
    }

    /// The Prometheus text exposition of everything recorded so far, less the series of
    /// label values no [`Exposure`] keeps any more.
    pub fn render(&self) -> String {
        let Some((_, h)) = &self.inner else {
            return String::new();
        };
        let mut text = h.render();
        buckets::render(
            &self.histograms.lock().unwrap_or_else(|e| e.into_inner()),
            &mut text,
        );
        let hidden: Vec<LabelPair> = self
            .exposures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, live)| **live == 0)
            .map(|((label, value), _)| LabelPair::new(label, value))
            .collect();
        if hidden.is_empty() {
            return text;
        }
        let mut kept = String::with_capacity(text.len());
        for line in text.split_inclusive('\n') {
            if !hidden.iter().any(|pair| pair.carried_by(line)) {
                kept.push_str(line);
            }
        }
        kept
    }
}

/// The telemetry of a program: served over HTTP when an address is given, discarded
/// otherwise (`--metrics-listen off`).
pub fn start(listen: Option<std::net::SocketAddr>) -> std::io::Result<Telemetry> {
    match listen {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instances_count_separately() {
        let a = Telemetry::new();
        let b = Telemetry::new();
        let f = &catalogue::CALLS_SENT_TOTAL;
        a.counter(f, &[("role", "x")]).increment(3);
        b.counter(f, &[("role", "x")]).increment(1);
        assert_eq!(sample(&a.render(), f.name, &[("role", "x")]), Some(3.0));
        assert_eq!(sample(&b.render(), f.name, &[]), Some(1.0));
        assert_eq!(sample(&b.render(), f.name, &[("role", "y")]), None);
    }

    #[test]
    #[should_panic(expected = "takes the labels")]
    fn a_registration_with_other_labels_than_the_catalogue_is_caught() {
        let _ = Telemetry::new().counter(&catalogue::CALLS_SENT_TOTAL, &[("kind", "x")]);
    }

    #[test]
    fn series_of_a_label_value_are_rendered_only_while_an_exposure_of_it_lives() {
        let t = Telemetry::new();
        let f = &catalogue::UPSTREAM_CALLS_TOTAL;
        let labels = |up| [("role", "broker"), ("upstream", up), ("status", "ok")];
        let a = t.exposure("upstream", "a:1");
        let again = t.exposure("upstream", "a:1");
        let _b = t.exposure("upstream", "a:10");
        t.counter(f, &labels("a:1")).increment(2);
        t.counter(f, &labels("a:10")).increment(5);
        let up = |t: &Telemetry, v| sample(&t.render(), f.name, &[("upstream", v)]);
        assert_eq!(up(&t, "a:1"), Some(2.0));
        drop(a);
        assert_eq!(up(&t, "a:1"), Some(2.0), "another exposure still lives");
        drop(again);
        assert_eq!(up(&t, "a:1"), None, "left out once none lives");
        // Only that value: one that merely starts the same stays, and so does the help.
        assert_eq!(up(&t, "a:10"), Some(5.0));
        assert!(t.render().contains(&format!("# TYPE {} counter", f.name)));
        // Shown again, its count goes on.
        let _back = t.exposure("upstream", "a:1");
        t.counter(f, &labels("a:1")).increment(1);
        assert_eq!(up(&t, "a:1"), Some(3.0));
    }

    #[test]
    fn histograms_use_the_latency_buckets() {
        let t = Telemetry::new();
        t.histogram(
            &catalogue::STAGE_SECONDS,
            &[("role", "p"), ("stage", "handler")],
        )
        .record(0.000_3);
        let text = t.render();
        assert!(
            text.contains(
                "rpcmesh_stage_seconds_bucket{role=\"p\",stage=\"handler\",le=\"0.0005\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("le=\"0.00001\""), "{text}");
    }
}
