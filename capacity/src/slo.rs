//! The service-level objective a capacity step must meet: latency percentiles of requests
//! (from their intended start) and the share of requests that did not succeed. Parsed from
//! `--slo 'p99<=20ms,errors<=0.1%'`; judged on a step's figures, each bound a step broke
//! named by a [`Breach`].

use std::fmt;
use std::str::FromStr;

use rpcmesh_common::format::ms;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::report::LatencySummary;

/// The SLO unless told otherwise: the red lines of the reference report's dashboard: p99
/// response time at most 200 ms, errors at most 0.1 %.
pub const DEFAULT_SLO: &str = "p99<=200ms,errors<=0.1%";

/// A latency bound: this percentile of request latency at most `max_ms`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct LatencyBound {
    /// `p50`, `p90`, `p99`, `p99.9`, `p99.99`, `max` or `mean`.
    pub percentile: Percentile,
    /// The bound, ms.
    pub max_ms: f64,
}

/// A latency figure an SLO can bound.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub enum Percentile {
    /// Mean.
    #[serde(rename = "mean")]
    Mean,
    /// Median.
    #[serde(rename = "p50")]
    P50,
    /// 90th percentile.
    #[serde(rename = "p90")]
    P90,
    /// 99th percentile.
    #[serde(rename = "p99")]
    P99,
    /// 99.9th percentile.
    #[serde(rename = "p99.9")]
    P999,
    /// 99.99th percentile.
    #[serde(rename = "p99.99")]
    P9999,
    /// Largest.
    #[serde(rename = "max")]
    Max,
}

impl Percentile {
    const ALL: [(Percentile, &'static str); 7] = [
        (Percentile::Mean, "mean"),
        (Percentile::P50, "p50"),
        (Percentile::P90, "p90"),
        (Percentile::P99, "p99"),
        (Percentile::P999, "p99.9"),
        (Percentile::P9999, "p99.99"),
        (Percentile::Max, "max"),
    ];

    /// Its name in an SLO.
    pub fn name(self) -> &'static str {
        Percentile::ALL
            .iter()
            .find(|(p, _)| *p == self)
            .map_or("?", |(_, n)| n)
    }

    /// Its value in `l`, ms.
    pub fn of(self, l: &LatencySummary) -> f64 {
        match self {
            Percentile::Mean => l.mean_ms,
            Percentile::P50 => l.p50_ms,
            Percentile::P90 => l.p90_ms,
            Percentile::P99 => l.p99_ms,
            Percentile::P999 => l.p999_ms,
            Percentile::P9999 => l.p9999_ms,
            Percentile::Max => l.max_ms,
        }
    }
}

/// What a step must meet.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Slo {
    /// As given (`p99<=200ms,errors<=0.1%`).
    pub text: String,
    /// Latency bounds, all of which must hold.
    pub latency: Vec<LatencyBound>,
    /// Most requests that may fail or go unsent, as a fraction of those due (0.001 = 0.1 %).
    pub max_error_ratio: f64,
}

impl Default for Slo {
    fn default() -> Self {
        DEFAULT_SLO.parse().expect("the default SLO parses")
    }
}

impl fmt::Display for Slo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl FromStr for Slo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut latency = Vec::new();
        let mut max_error_ratio = None;
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, value) = part
                .split_once("<=")
                .map(|(n, v)| (n.trim(), v.trim()))
                .ok_or_else(|| format!("{part:?}: expected NAME<=VALUE (e.g. p99<=20ms)"))?;
            if name.eq_ignore_ascii_case("errors") {
                let ratio = parse_ratio(value)
                    .ok_or_else(|| format!("{part:?}: errors take a share, e.g. 0.1% or 0.001"))?;
                max_error_ratio = Some(ratio);
                continue;
            }
            let percentile = Percentile::ALL
                .iter()
                .find(|(_, n)| n.eq_ignore_ascii_case(name))
                .map(|(p, _)| *p)
                .ok_or_else(|| {
                    format!("{part:?}: unknown figure {name:?} (mean, p50, p90, p99, p99.9, p99.99, max, errors)")
                })?;
            let d = rpcmesh_common::cli::values::parse_duration(value)
                .map_err(|e| format!("{part:?}: {e}"))?;
            if d.is_zero() {
                return Err(format!("{part:?}: the bound must be above zero"));
            }
            latency.push(LatencyBound {
                percentile,
                max_ms: d.as_secs_f64() * 1e3,
            });
        }
        if latency.is_empty() && max_error_ratio.is_none() {
            return Err(format!("{s:?}: an SLO needs at least one bound"));
        }
        Ok(Slo {
            text: s.trim().to_string(),
            latency,
            // Unbounded errors are not an SLO anyone means: without an `errors` clause,
            // every request must succeed.
            max_error_ratio: max_error_ratio.unwrap_or(0.0),
        })
    }
}

/// `0.1%` → 0.001; `0.001` → 0.001; between 0 and 1.
fn parse_ratio(v: &str) -> Option<f64> {
    let r = match v.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().ok()? / 100.0,
        None => v.parse::<f64>().ok()?,
    };
    (r.is_finite() && (0.0..=1.0).contains(&r)).then_some(r)
}

/// What a step broke: one bound of the SLO, or success itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Breach {
    /// A latency figure above its bound.
    Latency {
        /// The figure.
        percentile: Percentile,
        /// Its value, ms.
        value_ms: f64,
        /// Its bound, ms.
        max_ms: f64,
    },
    /// More requests failed or went unsent than the SLO allows.
    Errors {
        /// Those that did, a share of those due.
        ratio: f64,
        /// The SLO's bound.
        max_ratio: f64,
    },
    /// Not one request succeeded: the step measured a failure, not a rate.
    NothingSucceeded,
}

impl fmt::Display for Breach {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Breach::Latency {
                percentile,
                value_ms,
                max_ms,
            } => write!(
                f,
                "{} {} > {}",
                percentile.name(),
                ms(*value_ms),
                ms(*max_ms)
            ),
            Breach::Errors { ratio, max_ratio } => write!(
                f,
                "errors {:.3}% > {:.3}%",
                ratio * 100.0,
                max_ratio * 100.0
            ),
            Breach::NothingSucceeded => f.write_str("no request succeeded"),
        }
    }
}

impl Slo {
    /// What of this SLO a step with `latency` and `error_ratio` broke (empty: it passed).
    pub fn broken(&self, latency: &LatencySummary, error_ratio: f64) -> Vec<Breach> {
        let mut broken = Vec::new();
        for b in &self.latency {
            let v = b.percentile.of(latency);
            if v > b.max_ms {
                broken.push(Breach::Latency {
                    percentile: b.percentile,
                    value_ms: v,
                    max_ms: b.max_ms,
                });
            }
        }
        if error_ratio > self.max_error_ratio {
            broken.push(Breach::Errors {
                ratio: error_ratio,
                max_ratio: self.max_error_ratio,
            });
        }
        broken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lat(p99: f64) -> LatencySummary {
        LatencySummary {
            count: 100,
            p99_ms: p99,
            ..LatencySummary::default()
        }
    }

    #[test]
    fn the_default_is_the_reference_red_lines() {
        let s = Slo::default();
        assert_eq!(s.latency.len(), 1);
        assert_eq!(s.latency[0].percentile, Percentile::P99);
        assert!((s.latency[0].max_ms - 200.0).abs() < 1e-9);
        assert!((s.max_error_ratio - 0.001).abs() < 1e-12);
    }

    #[test]
    fn bounds_parse_and_judge() {
        let s: Slo = "p99<=20ms, p99.9 <= 0.1s ,errors<=1%".parse().unwrap();
        assert_eq!(s.latency.len(), 2);
        assert!(s.broken(&lat(19.0), 0.0).is_empty());
        assert_eq!(s.broken(&lat(21.0), 0.0).len(), 1);
        assert_eq!(s.broken(&lat(1.0), 0.02).len(), 1);
        let only_latency: Slo = "p50<=1ms".parse().unwrap();
        assert_eq!(only_latency.max_error_ratio, 0.0);
    }

    #[test]
    fn nonsense_is_refused_with_the_part_named() {
        for bad in [
            "",
            "p99",
            "p98<=1ms",
            "p99<=0ms",
            "errors<=200%",
            "errors<=x",
        ] {
            let e = bad.parse::<Slo>().unwrap_err();
            assert!(!e.is_empty(), "{bad}");
        }
    }
}
