//! Histograms with fixed buckets: a count per bucket and a sum, atomics all, so that a
//! sample costs two atomic updates and never an allocation, and their rendering in the
//! Prometheus text exposition.
//!
//! The exporter's own histograms keep each sample until a periodic upkeep folds them into
//! buckets: a sample now and then allocates a block for those to come, and every upkeep
//! allocates for every series. Stages are timed on the broker's forwarding path, which is
//! held to allocating nothing per call (`crate::alloc`), so the recorder keeps its
//! histograms here instead, and the exporter keeps the counters and gauges. Every
//! histogram has the recorder's latency buckets ([`LATENCY_BUCKETS`]).

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::metrics::catalogue::Family;
use crate::metrics::recorder::LATENCY_BUCKETS;

/// Buckets of every histogram: one per upper bound, and `+Inf`.
const BUCKETS: usize = LATENCY_BUCKETS.len() + 1;

/// One histogram series: how many samples fell in each bucket (not cumulative), and
/// their sum (the bits of an `f64`).
#[derive(Debug)]
pub struct Buckets {
    counts: [AtomicU64; BUCKETS],
    sum: AtomicU64,
}

impl Default for Buckets {
    fn default() -> Self {
        Buckets {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            sum: AtomicU64::new(0.0f64.to_bits()),
        }
    }
}

impl Buckets {
    /// Counts `value` in the first bucket whose bound it does not exceed; a NaN is
    /// dropped.
    pub fn record(&self, value: f64) {
        if value.is_nan() {
            return;
        }
        let i = LATENCY_BUCKETS.partition_point(|&bound| bound < value);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let mut current = self.sum.load(Ordering::Relaxed);
        loop {
            let next = (f64::from_bits(current) + value).to_bits();
            match self.sum.compare_exchange_weak(
                current,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(seen) => current = seen,
            }
        }
    }

    /// The samples so far, and their sum.
    pub fn count_and_sum(&self) -> (u64, f64) {
        let count = self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum();
        (count, f64::from_bits(self.sum.load(Ordering::Relaxed)))
    }
}

impl metrics::HistogramFn for Buckets {
    fn record(&self, value: f64) {
        Buckets::record(self, value);
    }
}

/// A registered series: its family, its labels (in the catalogue's order) and its counts.
#[derive(Debug)]
pub struct Series {
    pub family: &'static Family,
    pub labels: Vec<(&'static str, String)>,
    pub buckets: Arc<Buckets>,
}

/// Appends the text exposition of `series` to `out`, one block per family (its help, its
/// type, then each series' cumulative buckets, sum and count), families in name order.
pub fn render(series: &[Series], out: &mut String) {
    let mut order: Vec<&Series> = series.iter().collect();
    // Stable: a family's series keep the order they were registered in.
    order.sort_by_key(|s| s.family.name);
    let mut current = "";
    for s in order {
        let name = s.family.name;
        if name != current {
            if !current.is_empty() {
                out.push('\n');
            }
            let _ = writeln!(out, "# HELP {name} {}", s.family.help);
            let _ = writeln!(out, "# TYPE {name} histogram");
            current = name;
        }
        let labels = label_text(&s.labels);
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (i, count) in s.buckets.counts.iter().enumerate() {
            cumulative += count.load(Ordering::Relaxed);
            let le = match LATENCY_BUCKETS.get(i) {
                Some(bound) => bound.to_string(),
                None => "+Inf".to_string(),
            };
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {cumulative}"
            );
        }
        let sum = f64::from_bits(s.buckets.sum.load(Ordering::Relaxed));
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {sum}");
        let _ = writeln!(out, "{name}_count{braces} {cumulative}");
    }
    if !current.is_empty() {
        out.push('\n');
    }
}

/// `k1="v1",k2="v2"`, each value escaped as the text format wants.
fn label_text(labels: &[(&'static str, String)]) -> String {
    let mut text = String::new();
    for (i, (k, v)) in labels.iter().enumerate() {
        if i > 0 {
            text.push(',');
        }
        let _ = write!(text, "{k}=\"");
        for c in v.chars() {
            match c {
                '\\' => text.push_str("\\\\"),
                '"' => text.push_str("\\\""),
                '\n' => text.push_str("\\n"),
                c => text.push(c),
            }
        }
        text.push('"');
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::catalogue::STAGE_SECONDS;
    use crate::metrics::exposition::sample;

    fn series(labels: &[(&'static str, &str)]) -> Series {
        Series {
            family: &STAGE_SECONDS,
            labels: labels.iter().map(|(k, v)| (*k, v.to_string())).collect(),
            buckets: Arc::default(),
        }
    }

    #[test]
    fn samples_fall_in_the_first_bucket_whose_bound_they_do_not_exceed() {
        let s = series(&[("role", "broker"), ("stage", "total")]);
        for v in [0.000_01, 0.000_010_1, 0.003, 20.0, f64::NAN] {
            s.buckets.record(v);
        }
        let mut text = String::new();
        render(&[s], &mut text);
        let bucket = |le: &str| {
            sample(
                &text,
                "rpcmesh_stage_seconds_bucket",
                &[("stage", "total"), ("le", le)],
            )
        };
        assert_eq!(bucket("0.00001"), Some(1.0), "{text}");
        assert_eq!(bucket("0.00002"), Some(2.0));
        assert_eq!(bucket("0.005"), Some(3.0));
        assert_eq!(bucket("10"), Some(3.0));
        assert_eq!(bucket("+Inf"), Some(4.0), "the NaN is dropped");
        let count = sample(&text, "rpcmesh_stage_seconds_count", &[("stage", "total")]);
        assert_eq!(count, Some(4.0));
        let sum = sample(&text, "rpcmesh_stage_seconds_sum", &[]).unwrap_or(0.0);
        assert!((sum - 20.003_020_1).abs() < 1e-9, "{sum}");
    }

    #[test]
    fn a_family_is_one_block_and_label_values_are_escaped() {
        let a = series(&[("role", "broker"), ("stage", "total")]);
        let b = series(&[("role", "broker"), ("stage", "a\"b\\c")]);
        b.buckets.record(0.5);
        let mut text = String::new();
        render(&[a, b], &mut text);
        assert_eq!(
            text.matches("# TYPE rpcmesh_stage_seconds histogram")
                .count(),
            1
        );
        assert!(text.contains(r#"stage="a\"b\\c",le="0.5"} 1"#), "{text}");
    }
}
